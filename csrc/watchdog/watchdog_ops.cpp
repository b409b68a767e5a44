// The watchdog's op: _watchdog_state, what te_ep_torch reports of the
// watchdog (csrc/watchdog/core/watchdog.h). A handle's watched ops are named
// and limited by comm/ (enter_watched_op, WatchedOps in comm/backend.h).
#include <torch/library.h>

#include <stdexcept>
#include <string>
#include <tuple>

#include "watchdog/core/watchdog.h"

namespace te_ep {

TORCH_LIBRARY_IMPL(te_ep, CompositeExplicitAutograd, m) {
  m.impl("_watchdog_state", []() -> std::tuple<std::string, int64_t, int64_t> {
    std::string action;
    try {
      action = watchdog::action_name(watchdog::action());
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK(false, "te_ep: ", e.what());
    }
    return {action, watchdog::pending(), watchdog::fired()};
  });
}

}  // namespace te_ep
