// job.interface (lib/config/interface.h): an interface by name, the one on
// the route to the coordinator, and what they do to the runtime's options;
// the route checked for real in a network namespace of its own.
#include "lib/config/interface.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>

#include "tests/test_process.h"

namespace psld {
namespace {

using ::testing::HasSubstr;
using testing::psld;
using testing::run_process;
using testing::RunResult;

TEST(Interface, ByName) {
  auto lo = find_interface("lo");
  ASSERT_TRUE(lo.ok()) << lo.status().to_string();
  EXPECT_EQ(lo->name, "lo");
  EXPECT_EQ(lo->address, "127.0.0.1");

  auto none = find_interface("nosuch0");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(none.status().message(), HasSubstr("no network interface 'nosuch0'"));
  EXPECT_THAT(none.status().message(), HasSubstr("lo 127.0.0.1"));  // what there is
}

TEST(Interface, TowardAnAddress) {
  auto lo = interface_toward("127.0.0.1:29600");
  ASSERT_TRUE(lo.ok()) << lo.status().to_string();
  EXPECT_EQ(lo->name, "lo");
  EXPECT_EQ(lo->address, "127.0.0.1");

  auto bad = interface_toward("no-port");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  auto unknown = interface_toward("nohost.invalid:1");
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(unknown.status().message(), HasSubstr("cannot resolve 'nohost.invalid'"));
}

TEST(Interface, ShapesTheListenAddressUnlessItWasSet) {
  Config c;
  c.job.interface = "lo";
  RuntimeOptions o = runtime_options_from_config(c);
  o.net.options.common.listen_address = "0.0.0.0:5555";  // the host is replaced, the port kept
  ASSERT_TRUE(apply_interface(c, o).ok());
  EXPECT_EQ(o.net.options.common.interface, "lo");
  EXPECT_EQ(o.net.options.common.listen_address, "127.0.0.1:5555");

  // Set by a source: kept.
  c.sources["job.listen"] = "flag --job.listen";
  c.job.listen = "127.0.0.1:7000";
  o = runtime_options_from_config(c);
  ASSERT_TRUE(apply_interface(c, o).ok());
  EXPECT_EQ(o.net.options.common.listen_address, "127.0.0.1:7000");
  EXPECT_EQ(o.net.options.common.interface, "lo");

  // auto: toward the coordinator.
  Config a;
  a.job.interface = "auto";
  a.job.coordinator = "127.0.0.1:29600";
  o = runtime_options_from_config(a);
  ASSERT_TRUE(apply_interface(a, o).ok());
  EXPECT_EQ(o.net.options.common.interface, "lo");

  // Empty: nothing changes.
  Config e;
  o = runtime_options_from_config(e);
  ASSERT_TRUE(apply_interface(e, o).ok());
  EXPECT_EQ(o.net.options.common.interface, "");
  EXPECT_EQ(o.net.options.common.listen_address, e.job.listen);

  Config bad;
  bad.job.interface = "nosuch0";
  o = runtime_options_from_config(bad);
  Status s = apply_interface(bad, o);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("job.interface = nosuch0"));
}

// ip(8), by its path (run_process does not search PATH); "" when absent.
std::string ip_command() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (::access(p, X_OK) == 0) return p;
  }
  return "";
}

// A network namespace with one veth pair to this one, removed (with the
// pair) when the test ends, whatever happened.
class Namespace {
 public:
  explicit Namespace(int tag)
      : name_("psld-if" + std::to_string(tag)),
        host_dev_("psldh" + std::to_string(tag)),
        ns_dev_("psldn" + std::to_string(tag)),
        host_ip_("10.213." + std::to_string(tag % 250) + ".1"),
        ns_ip_("10.213." + std::to_string(tag % 250) + ".2") {}
  ~Namespace() {
    sh("ip netns del " + name_);
    sh("ip link del " + host_dev_);
  }
  // "" when it is up, else why not. What a run killed before its cleanup
  // left under these names goes first.
  std::string up() {
    sh("ip netns del " + name_);
    sh("ip link del " + host_dev_);
    const std::string steps[] = {
        "ip netns add " + name_,
        "ip link add " + host_dev_ + " type veth peer name " + ns_dev_,
        "ip link set " + ns_dev_ + " netns " + name_,
        "ip addr add " + host_ip_ + "/24 dev " + host_dev_,
        "ip link set " + host_dev_ + " up",
        "ip netns exec " + name_ + " ip addr add " + ns_ip_ + "/24 dev " + ns_dev_,
        "ip netns exec " + name_ + " ip link set " + ns_dev_ + " up",
        "ip netns exec " + name_ + " ip link set lo up",
    };
    for (const std::string& step : steps) {
      if (sh(step) != 0) return "'" + step + "' failed";
    }
    return "";
  }
  RunResult run(const std::vector<std::string>& argv) const {
    std::vector<std::string> in = {ip_command(), "netns", "exec", name_};
    in.insert(in.end(), argv.begin(), argv.end());
    return run_process(in, {}, std::chrono::seconds(30));
  }
  const std::string& ns_dev() const { return ns_dev_; }
  const std::string& host_ip() const { return host_ip_; }
  const std::string& ns_ip() const { return ns_ip_; }

 private:
  static int sh(const std::string& command) {
    return std::system((command + " >/dev/null 2>&1").c_str());
  }
  std::string name_, host_dev_, ns_dev_, host_ip_, ns_ip_;
};

// Inside a namespace whose only route out is a veth pair, auto finds that
// pair's end and its address; `psld config` shows what a process there
// would listen on.
TEST(Interface, AutoFollowsTheRouteInANetworkNamespace) {
  if (geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
  if (ip_command().empty()) GTEST_SKIP() << "no ip(8) here";
  Namespace ns(static_cast<int>(getpid() % 10000));
  if (const std::string why = ns.up(); !why.empty()) {
    GTEST_SKIP() << "cannot make a network namespace here: " << why;
  }
  RunResult r = ns.run({psld(), "config", "--job.interface=auto",
                        "--job.coordinator=" + ns.host_ip() + ":29600", "--job.transport=ucx"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output,
              HasSubstr("# interface: " + ns.ns_dev() + ", listening on " + ns.ns_ip() + ":0"));
  // By name too; and a name that is not there fails as the start would.
  r = ns.run({psld(), "config", "--job.interface=" + ns.ns_dev()});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("listening on " + ns.ns_ip() + ":0"));
  r = ns.run({psld(), "config", "--job.interface=eth9"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("no network interface 'eth9'"));
}

}  // namespace
}  // namespace psld
