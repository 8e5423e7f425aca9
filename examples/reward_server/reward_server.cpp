// The example reward server: serves one tandem reward function over Thrift until SIGINT/SIGTERM.
//
//   build/bin/tandem_reward_server --port 9090 --kind math_answer
//   build/bin/tandem_reward_server --port 0 --kind regex_format --options '{"pattern": "####.*"}'
//
// It prints "listening on PORT" on stdout once it accepts connections (PORT is the chosen one
// when --port is 0). A job uses it with a [[rewards]] entry of kind = "remote". On SIGINT/SIGTERM
// it stops taking connections and lets the calls in progress finish for at most
// --stop-timeout-ms (or until a second signal), then exits all the same.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>

#include "core/error.h"
#include "rewards/factory.h"
#include "rewards/remote_server.h"

int main(int argc, char** argv) {
  CLI::App app{
      "tandem_reward_server: a tandem reward function over Thrift (rewards/reward.thrift)"};
  tandem::rewards::RewardServer::Options o;
  std::string kind = "math_answer";
  std::string options_json = "{}";
  app.add_option("--host", o.host, "Address to bind (127.0.0.1: this machine only)")
      ->capture_default_str();
  app.add_option("--port", o.port, "Port; 0: a free one, printed when listening")
      ->capture_default_str();
  app.add_option("--kind", kind, "The reward function (docs/rewards.md)")->capture_default_str();
  app.add_option("--options", options_json, "Its options, a JSON object")->capture_default_str();
  app.add_option("--name", o.name, "The name in info() and in logs")->capture_default_str();
  app.add_option("--token", o.token, "Require this shared token of every score request");
  app.add_option("--max-batch-size", o.max_batch_size, "Samples per request at most")
      ->capture_default_str();
  app.add_option("--max-message-bytes", o.max_message_bytes, "Bytes per request at most")
      ->capture_default_str();
  app.add_option("--max-connections", o.max_connections, "Connections served at once")
      ->capture_default_str();
  app.add_option("--max-in-flight", o.max_in_flight,
                 "Score calls admitted at once; one more is answered with Overloaded")
      ->capture_default_str();
  int64_t stop_timeout_ms = 5000;
  app.add_option("--stop-timeout-ms", stop_timeout_ms,
                 "After SIGTERM, how long calls in progress may finish before the exit")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{3'600'000}));
  CLI11_PARSE(app, argc, argv);

  // The signals are taken by sigwait below, so every thread the server starts must block them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  try {
    const nlohmann::json options = nlohmann::json::parse(options_json, nullptr, false);
    TANDEM_CHECK(options.is_object(), "--options must be a JSON object, got '{}'", options_json);
    std::shared_ptr<tandem::rewards::RewardFunction> function =
        tandem::rewards::make_reward(kind, o.name, options);
    tandem::rewards::RewardServer server(function, o);
    std::printf("listening on %d\n", server.port());
    std::fflush(stdout);
    int signal = 0;
    sigwait(&stop_signals, &signal);
    std::fprintf(stderr, "tandem_reward_server: %s, stopping\n", strsignal(signal));
    // A call that does not return (a hung function) must not keep the process alive.
    std::thread([&stop_signals, stop_timeout_ms] {
      const timespec timeout{static_cast<time_t>(stop_timeout_ms / 1000),
                             static_cast<long>(stop_timeout_ms % 1000) * 1'000'000};
      siginfo_t info;
      const bool again = sigtimedwait(&stop_signals, &info, &timeout) > 0;
      std::fprintf(stderr, "tandem_reward_server: %s; exiting with calls in progress\n",
                   again ? "signalled again" : "calls still in progress after --stop-timeout-ms");
      std::fflush(stderr);
      std::_Exit(1);
    }).detach();
    server.stop();
    const auto stats = server.stats();
    std::fprintf(stderr,
                 "tandem_reward_server: stopped; %lld calls scored, %lld overloaded, %lld "
                 "connections refused for a request over a limit\n",
                 static_cast<long long>(stats.scored), static_cast<long long>(stats.overloaded),
                 static_cast<long long>(stats.refused));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem_reward_server: %s\n", e.what());
    return 1;
  }
  return 0;
}
