// The other process of transport_peer_death_test: a listening transport that
// exports two regions and progresses until it is killed.
//
//   transport_peer_death_child <transport> <ucx_tls>
//
// Prints, one per line on stdout:
//   SKIP <reason>            the backend is unavailable here (then exits 0)
//   ADDR <hex>               its Transport::address()
//   KEY <hex>                the remote key of an allocate_memory region
//   KEY <hex>                the remote key of a register_memory region
//   READY
// and then serves until SIGKILL (or until stdin closes, so that it never
// outlives a parent that died without killing it).
#include <poll.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "transports/transport.h"

namespace {

using namespace psld::transport;

class Quiet : public Handler {
 public:
  void on_write(const ConnectionPtr&, uint32_t, uint64_t) override {}
  void on_message(const ConnectionPtr&, std::span<const uint8_t>) override {}
};

std::string hex(std::span<const uint8_t> bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (uint8_t b : bytes) {
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

bool stdin_closed() {
  pollfd p{0, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  char c;
  return read(0, &c, 1) <= 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <transport> <ucx_tls>\n", argv[0]);
    return 2;
  }
  Quiet handler;
  TransportOptions o;
  o.common.op_timeout = std::chrono::seconds(2);
  o.ucx.tls = argv[2];
  auto t = create_transport(argv[1], o, &handler);
  if (!t.ok()) {
    std::printf("SKIP %s\n", t.status().to_string().c_str());
    std::fflush(stdout);
    return 0;
  }
  constexpr size_t kBytes = 4 << 20;
  auto allocated = (*t)->allocate_memory(kBytes, psld::MemoryKind::kHost);
  std::vector<uint8_t> heap(kBytes);
  auto registered = (*t)->register_memory(heap.data(), heap.size(), psld::MemoryKind::kHost);
  if (!allocated.ok() || !registered.ok()) {
    std::fprintf(stderr, "child: cannot make regions\n");
    return 1;
  }
  std::printf("ADDR %s\nKEY %s\nKEY %s\nREADY\n", hex((*t)->address()).c_str(),
              hex((*allocated)->remote_key()).c_str(), hex((*registered)->remote_key()).c_str());
  std::fflush(stdout);
  for (int i = 0;; ++i) {
    if ((*t)->progress() == 0) (*t)->wait(std::chrono::milliseconds(1));
    if (i % 1024 == 0 && stdin_closed()) return 0;
  }
}
