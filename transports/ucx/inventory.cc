// What UCX offers on this machine (psld doctor): its version and every
// transport/device pair its components report, as `ucx_info -d` lists them.
#include <fmt/format.h>
#include <uct/api/uct.h>

#include <memory>
#include <vector>

#include "transports/ucx/core.h"
#include "transports/ucx/ucx_transport.h"

namespace psld::transport {

Result<UcxInventory> ucx_inventory() {
  UcxInventory out;
  out.version = ucp_get_version_string();
  uct_component_h* components = nullptr;
  unsigned num_components = 0;
  if (ucs_status_t st = uct_query_components(&components, &num_components); st != UCS_OK) {
    return ucx_detail::ucs_to_status(st, "uct_query_components");
  }
  std::unique_ptr<uct_component_h, decltype(&uct_release_component_list)> hold(
      components, uct_release_component_list);
  for (unsigned c = 0; c < num_components; ++c) {
    uct_component_attr_t attr{};
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
    if (uct_component_query(components[c], &attr) != UCS_OK) continue;
    std::vector<uct_md_resource_desc_t> mds(attr.md_resource_count);
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
    attr.md_resources = mds.data();
    if (mds.empty() || uct_component_query(components[c], &attr) != UCS_OK) continue;
    for (const auto& md_desc : mds) {
      uct_md_config_t* config = nullptr;
      if (uct_md_config_read(components[c], nullptr, nullptr, &config) != UCS_OK) continue;
      uct_md_h md = nullptr;
      const ucs_status_t opened = uct_md_open(components[c], md_desc.md_name, config, &md);
      uct_config_release(config);
      if (opened != UCS_OK) {
        out.problems.push_back(
            fmt::format("{}: cannot open: {}", md_desc.md_name, ucs_status_string(opened)));
        continue;
      }
      uct_tl_resource_desc_t* tls = nullptr;
      unsigned num_tls = 0;
      if (uct_md_query_tl_resources(md, &tls, &num_tls) == UCS_OK) {
        for (unsigned t = 0; t < num_tls; ++t) {
          out.transports.push_back(fmt::format("{}/{}", tls[t].tl_name, tls[t].dev_name));
        }
        uct_release_tl_resource_list(tls);
      }
      uct_md_close(md);
    }
  }
  return out;
}

}  // namespace psld::transport
