// Ranks as threads of one test process: each with its own communicator, meeting in a file store
// (Gloo over loopback).
#pragma once

#include <catch2/catch.hpp>

#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/comm.h"

namespace tandem::test {

// Runs fn(rank, comm) on `world` threads joined in a file store under dir; every thread's error
// fails the test. Returns each rank's error ("" when none) for tests that expect some.
template <class Fn>
std::vector<std::string> on_ranks(int world, const std::string& dir, Fn fn,
                                  bool expect_errors = false, double timeout_s = 30) {
  std::filesystem::create_directories(dir);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        rendezvous::RankInfo info;
        info.rank = r;
        info.world_size = world;
        info.master_addr = "127.0.0.1";
        info.launcher = "test";
        CommOptions o;
        o.timeout_s = timeout_s;
        o.store = "file:" + dir;
        std::unique_ptr<Communicator> comm = Communicator::create(info, o);
        fn(r, *comm);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (!expect_errors)
    for (const std::string& e : errors) CHECK(e == std::string());
  return errors;
}

}  // namespace tandem::test
