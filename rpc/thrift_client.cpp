// The parsing of a Thrift client's peer address.
#include "rpc/thrift_client.h"

#include "core/error.h"

namespace tandem {

Endpoint parse_endpoint(const std::string& a, const std::string& what, int example_port) {
  const size_t colon = a.rfind(':');
  const bool port_ok = colon != std::string::npos && colon + 1 < a.size() &&
                       a.size() - colon <= 6 &&
                       a.find_first_not_of("0123456789", colon + 1) == std::string::npos;
  TANDEM_CHECK(port_ok && colon > 0, "{}: address '{}' is not host:port (e.g. 127.0.0.1:{})", what,
               a, example_port);
  Endpoint e;
  e.host = a.substr(0, colon);
  if (e.host.size() > 2 && e.host.front() == '[' && e.host.back() == ']')  // [::1]:9090
    e.host = e.host.substr(1, e.host.size() - 2);
  e.port = std::stoi(a.substr(colon + 1));
  TANDEM_CHECK(e.port >= 1 && e.port <= 65535, "{}: port {} of '{}' is not 1..65535", what, e.port,
               a);
  return e;
}

}  // namespace tandem
