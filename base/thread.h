// start_thread: std::thread without the exception. std::thread's constructor
// throws std::system_error when the system has no thread to give (EAGAIN at
// the process's or the user's limit); psld returns errors as values and never
// lets an exception reach the trainer's code, so every thread it starts goes
// through here.
#pragma once

#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include "psld/status.h"

namespace psld {

template <typename Fn>
Status start_thread(std::thread& thread, std::string_view what, Fn&& fn) {
  try {
    thread = std::thread(std::forward<Fn>(fn));
    return Status::Ok();
  } catch (const std::system_error& e) {
    return ResourceExhausted("cannot start the " + std::string(what) + " thread: " + e.what());
  }
}

}  // namespace psld
