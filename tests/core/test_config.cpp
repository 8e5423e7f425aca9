// Tests of the schema-driven TOML config layer: defaults, errors with their positions, overrides,
// printing back and the Markdown reference.
#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/error.h"

namespace cfg = tandem::config;

namespace {

std::shared_ptr<const cfg::Schema> test_schema() {
  auto items = std::make_shared<cfg::Schema>();
  items->add(cfg::text("name", "", "entry name")).must_set();
  items->add(cfg::real("weight", 1.0, "entry weight")).range(0, 10);
  auto s = std::make_shared<cfg::Schema>();
  s->describe("run", "What runs.");
  s->add(cfg::text("run.path", "", "a path")).must_set();
  s->add(cfg::integer("run.n", 4, "samples")).range(2, 64);
  s->add(cfg::real("run.lr", 1e-6, "learning rate")).above(0).range(0, 1);
  s->add(cfg::boolean("run.fast", false, "go fast"));
  s->add(cfg::text("run.mode", "a", "mode")).one_of({"a", "b"});
  s->add(cfg::text_list("run.tags", {"x"}, "tags"));
  s->add(cfg::integer("run.inner.depth", 3, "a nested key"));
  s->add(cfg::table_array("entries", items, "entries"));
  return s;
}

std::string error_of(std::string_view text, std::vector<std::string> overrides = {}) {
  try {
    cfg::parse(test_schema(), text, "job.toml", overrides);
  } catch (const tandem::Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("config fills the keys a file leaves out with their defaults", "[unit]") {
  auto c = cfg::parse(test_schema(), "[run]\npath = \"p\"\nn = 8\n", "job.toml");
  CHECK(c.get_string("run.path") == "p");
  CHECK(c.get_int("run.n") == 8);
  CHECK(c.get_float("run.lr") == 1e-6);
  CHECK_FALSE(c.get_bool("run.fast"));
  CHECK(c.get_string("run.mode") == "a");
  CHECK(c.get_strings("run.tags") == std::vector<std::string>{"x"});
  CHECK(c.get_int("run.inner.depth") == 3);
  CHECK(c.get_tables("entries").empty());
  CHECK(c.is_set("run.n"));
  CHECK_FALSE(c.is_set("run.lr"));
  CHECK(c.where("run.n") == "job.toml:3:5");
  CHECK(c.where("run.lr") == "job.toml (default)");
}

TEST_CASE("config errors name the file line and column of each bad value", "[unit]") {
  const std::string ok = "[run]\npath = \"p\"\n";
  // unknown key, with the closest known one
  auto e = error_of(ok + "nn = 3\n");
  CHECK_THAT(e, Catch::Contains("job.toml:3:1: unknown key 'run.nn' (did you mean 'run.n'?)"));
  CHECK_THAT(error_of(ok + "[other]\nx = 1\n"),
             Catch::Contains("job.toml:3:2: unknown key 'other'"));
  // wrong types
  CHECK_THAT(error_of(ok + "n = \"8\"\n"),
             Catch::Contains("job.toml:3:5: run.n: expected an integer, found the string \"8\""));
  CHECK_THAT(error_of(ok + "n = 2.5\n"),
             Catch::Contains("job.toml:3:5: run.n: expected an integer, found the float 2.5"));
  CHECK_THAT(error_of(ok + "fast = 1\n"),
             Catch::Contains("job.toml:3:8: run.fast: expected a boolean, found the integer 1"));
  CHECK_THAT(error_of(ok + "lr = true\n"),
             Catch::Contains("job.toml:3:6: run.lr: expected a number, found the boolean true"));
  CHECK_THAT(error_of(ok + "tags = [\"a\", 2]\n"),
             Catch::Contains("run.tags: expected an array of strings, found the integer 2 at "
                             "index 1"));
  CHECK_THAT(error_of(ok + "inner = 3\n"),
             Catch::Contains("job.toml:3:1: unknown key 'run.inner'"));
  // out of range and not one of the choices
  CHECK_THAT(error_of(ok + "n = 1\n"),
             Catch::Contains("job.toml:3:5: run.n: expected an integer >= 2 and <= 64, found 1"));
  CHECK_THAT(error_of(ok + "lr = 0\n"),
             Catch::Contains("job.toml:3:6: run.lr: expected a number > 0 and <= 1, found 0.0"));
  CHECK_THAT(error_of(ok + "lr = nan\n"), Catch::Contains("run.lr: expected a finite number"));
  CHECK_THAT(error_of(ok + "mode = \"c\"\n"),
             Catch::Contains("job.toml:3:8: run.mode: expected one of \"a\", \"b\", found \"c\""));
  // syntax, required keys, table arrays and their entries
  CHECK_THAT(error_of("[run]\npath = \n"), Catch::Contains("job.toml:2:"));
  CHECK_THAT(error_of("[run]\npath = \n"), Catch::Contains("TOML syntax error"));
  CHECK_THAT(error_of("[run]\nn = 3\n"), Catch::Contains("run.path: required but not set"));
  CHECK_THAT(error_of(ok + "[[entries]]\nname = \"a\"\nweight = 11\n"),
             Catch::Contains("job.toml:5:10: entries[0].weight: expected a number >= 0 and <= 10"));
  CHECK_THAT(error_of(ok + "[[entries]]\nname = \"a\"\n[[entries]]\nwieght = 1\n"),
             Catch::Contains("job.toml:6:1: unknown key 'entries[1].wieght' (did you mean "
                             "'weight'?)"));
  CHECK_THAT(error_of(ok + "[[entries]]\nweight = 1\n"),
             Catch::Contains("job.toml:3:1: entries[0].name: required but not set"));
  CHECK_THAT(error_of("entries = 3\n" + ok), Catch::Contains("job.toml:1:11: entries: expected an "
                                                             "array of tables"));
  // every problem is reported, one per line
  auto many = error_of(ok + "n = 1\nmode = \"z\"\n");
  CHECK_THAT(many, Catch::Contains("job.toml:3:5") && Catch::Contains("job.toml:4:8"));
}

TEST_CASE("config overrides win over the file and are named in errors", "[unit]") {
  std::vector<std::string> overrides = {
      "run.n=16",     "run.lr=1e-5", "run.path=\"q\"", "run.mode=b", "run.tags=[\"u\", \"v\"]",
      "run.fast=true"};
  auto c = cfg::parse(test_schema(), "[run]\npath = \"p\"\nn = 8\n", "job.toml", overrides);
  CHECK(c.get_int("run.n") == 16);
  CHECK(c.get_float("run.lr") == 1e-5);
  CHECK(c.get_string("run.path") == "q");
  CHECK(c.get_string("run.mode") == "b");  // a bare word for a string key
  CHECK(c.get_strings("run.tags") == std::vector<std::string>{"u", "v"});
  CHECK(c.get_bool("run.fast"));
  CHECK(c.where("run.n") == "override 'run.n=16'");

  const std::string ok = "[run]\npath = \"p\"\n";
  CHECK_THAT(error_of(ok, {"run.n=1"}), Catch::Contains("override 'run.n=1': run.n: expected an "
                                                        "integer >= 2 and <= 64, found 1"));
  CHECK_THAT(error_of(ok, {"run.n=abc"}),
             Catch::Contains("override 'run.n=abc': run.n: expected integer, found 'abc' which "
                             "is not a TOML value"));
  CHECK_THAT(error_of(ok, {"run.lrr=1"}),
             Catch::Contains("override 'run.lrr=1': unknown key 'run.lrr' (did you mean "
                             "'run.lr'?)"));
  CHECK_THAT(error_of(ok, {"run.n"}), Catch::Contains("override 'run.n': expected key.sub=value"));
  CHECK_THAT(error_of(ok, {"entries=[]"}), Catch::Contains("can only be set in the file"));
  CHECK_THAT(error_of("[run]\n", {"run.path=x"}), !Catch::Contains("required"));
}

TEST_CASE("config printed as TOML parses back to the same config", "[unit]") {
  const std::string text =
      "[run]\npath = \"a \\\"quoted\\\"\\tpath\"\nn = 16\nlr = 3.5e-7\ntags = []\n"
      "[run.inner]\ndepth = -2\n[[entries]]\nname = \"e1\"\n[[entries]]\nname = \"e2\"\n"
      "weight = 0.25\n";
  auto c = cfg::parse(test_schema(), text, "job.toml", std::vector<std::string>{"run.mode=b"});
  auto printed = cfg::print_toml(c);
  auto back = cfg::parse(test_schema(), printed, "printed.toml");
  auto body = [](const std::string& s) { return s.substr(s.find('\n')); };  // after the title
  CHECK(body(cfg::print_toml(back)) == body(printed));
  CHECK(back.get_string("run.path") == "a \"quoted\"\tpath");
  CHECK(back.get_int("run.n") == 16);
  CHECK(back.get_float("run.lr") == 3.5e-7);
  CHECK(back.get_string("run.mode") == "b");
  CHECK(back.get_strings("run.tags").empty());
  CHECK(back.get_int("run.inner.depth") == -2);
  REQUIRE(back.get_tables("entries").size() == 2);
  CHECK(back.get_tables("entries")[1].get_float("weight") == 0.25);
  CHECK(back.get_tables("entries")[0].get_float("weight") == 1.0);
  CHECK_THAT(printed, Catch::Contains("n = 16  # default: 4"));
}

TEST_CASE("config schema refuses a default outside its own range", "[unit]") {
  cfg::Schema s;
  s.add(cfg::integer("a.n", 4, "n")).range(2, 8);
  CHECK_THROWS_AS(s.add(cfg::integer("a.n", 4, "again")), tandem::Error);
  CHECK_THROWS_AS(s.add(cfg::integer("a.m", 1, "m").range(2, 8)), tandem::Error);
  auto md = cfg::markdown(s);
  CHECK_THAT(md, Catch::Contains("| `a.n` | integer | `4` | n Range: >= 2 and <= 8. |"));
}
