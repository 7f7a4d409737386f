#include "psld/status.h"

namespace psld {

std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kAlreadyExists:
      return "AlreadyExists";
    case StatusCode::kOutOfRange:
      return "OutOfRange";
    case StatusCode::kFailedPrecondition:
      return "FailedPrecondition";
    case StatusCode::kResourceExhausted:
      return "ResourceExhausted";
    case StatusCode::kUnavailable:
      return "Unavailable";
    case StatusCode::kTimeout:
      return "Timeout";
    case StatusCode::kAborted:
      return "Aborted";
    case StatusCode::kDataLoss:
      return "DataLoss";
    case StatusCode::kMoved:
      return "Moved";
    case StatusCode::kUnimplemented:
      return "Unimplemented";
    case StatusCode::kInternal:
      return "Internal";
  }
  return "Unknown";
}

Status::Status(StatusCode code, std::string message) {
  if (code != StatusCode::kOk) state_ = std::make_unique<State>(State{code, std::move(message)});
}

Status::Status(const Status& other)
    : state_(other.state_ ? std::make_unique<State>(*other.state_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) state_ = other.state_ ? std::make_unique<State>(*other.state_) : nullptr;
  return *this;
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return state_ ? state_->message : kEmpty;
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  std::string out(status_code_name(code()));
  out += ": ";
  out += state_->message;
  return out;
}

Status Status::with_context(std::string_view context) const {
  if (ok()) return Status();
  std::string msg(context);
  msg += ": ";
  msg += state_->message;
  return Status(state_->code, std::move(msg));
}

Status InvalidArgument(std::string m) {
  return Status(StatusCode::kInvalidArgument, std::move(m));
}
Status NotFound(std::string m) {
  return Status(StatusCode::kNotFound, std::move(m));
}
Status AlreadyExists(std::string m) {
  return Status(StatusCode::kAlreadyExists, std::move(m));
}
Status OutOfRange(std::string m) {
  return Status(StatusCode::kOutOfRange, std::move(m));
}
Status FailedPrecondition(std::string m) {
  return Status(StatusCode::kFailedPrecondition, std::move(m));
}
Status ResourceExhausted(std::string m) {
  return Status(StatusCode::kResourceExhausted, std::move(m));
}
Status Unavailable(std::string m) {
  return Status(StatusCode::kUnavailable, std::move(m));
}
Status Timeout(std::string m) {
  return Status(StatusCode::kTimeout, std::move(m));
}
Status Aborted(std::string m) {
  return Status(StatusCode::kAborted, std::move(m));
}
Status DataLoss(std::string m) {
  return Status(StatusCode::kDataLoss, std::move(m));
}
Status Moved(std::string m) {
  return Status(StatusCode::kMoved, std::move(m));
}
Status Unimplemented(std::string m) {
  return Status(StatusCode::kUnimplemented, std::move(m));
}
Status Internal(std::string m) {
  return Status(StatusCode::kInternal, std::move(m));
}

}  // namespace psld
