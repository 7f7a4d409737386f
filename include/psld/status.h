// psld/status.h — error values.
//
// Every fallible call in psld returns a Status or a Result<T>. The library
// never throws across its API and never aborts the caller's process: a failure
// is a value that says what happened and, where it can, what to do about it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace psld {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,     // the caller passed a bad value; retrying will not help
  kNotFound,            // a name, key or peer that does not exist
  kAlreadyExists,       // registering something twice with a different meaning
  kOutOfRange,          // an offset, index or length outside its bounds
  kFailedPrecondition,  // the object is not in a state that allows the call
  kResourceExhausted,   // a bounded ring, pool or credit window is full
  kUnavailable,         // the peer is gone or unreachable
  kTimeout,             // the operation did not complete in time
  kAborted,             // the operation was cancelled (shutdown, migration abort)
  kDataLoss,            // a message failed validation (size, checksum, epoch)
  kMoved,               // a key is owned by another server in a newer epoch
  kUnimplemented,       // the backend or build lacks the feature
  kInternal,            // a broken invariant of psld itself: please report it
};

// The code's name, e.g. "InvalidArgument".
std::string_view status_code_name(StatusCode code);

// A success, or a code with a human-readable message. Ok statuses are free
// (no allocation); an error holds its message on the heap.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message);

  static Status Ok() { return Status(); }

  bool ok() const { return state_ == nullptr; }
  StatusCode code() const { return state_ ? state_->code : StatusCode::kOk; }
  // The message without the code; empty for Ok.
  const std::string& message() const;
  // "Code: message", or "OK".
  std::string to_string() const;

  // The same error with "context: " in front of the message (Ok stays Ok).
  Status with_context(std::string_view context) const;

  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;
  ~Status() = default;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct State {
    StatusCode code;
    std::string message;
  };
  std::unique_ptr<State> state_;
};

Status InvalidArgument(std::string message);
Status NotFound(std::string message);
Status AlreadyExists(std::string message);
Status OutOfRange(std::string message);
Status FailedPrecondition(std::string message);
Status ResourceExhausted(std::string message);
Status Unavailable(std::string message);
Status Timeout(std::string message);
Status Aborted(std::string message);
Status DataLoss(std::string message);
Status Moved(std::string message);
Status Unimplemented(std::string message);
Status Internal(std::string message);

// A value of type T, or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
  static_assert(!std::is_same_v<std::remove_cv_t<T>, Status>, "Result<Status> is meaningless");

 public:
  // Implicit from a value and from an error, so `return value;` and
  // `return InvalidArgument(...);` both work.
  Result(T value) : v_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(v_).ok()) {
      v_ = Status(StatusCode::kInternal, "Result constructed from an Ok status without a value");
    }
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  // Ok when there is a value.
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }

  // Access the value; only valid when ok() (checked: a bad access is a bug in
  // the caller, reported as std::bad_variant_access in debug and release).
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  template <typename U>
  T value_or(U&& fallback) const& {
    return ok() ? std::get<T>(v_) : static_cast<T>(std::forward<U>(fallback));
  }

 private:
  std::variant<T, Status> v_;
};

}  // namespace psld

// Return the status of `expr` from the enclosing function if it is an error.
#define PSLD_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::psld::Status psld_status_ = (expr);        \
    if (!psld_status_.ok()) return psld_status_; \
  } while (false)

#define PSLD_CONCAT_INNER_(a, b) a##b
#define PSLD_CONCAT_(a, b) PSLD_CONCAT_INNER_(a, b)
// NOLINTBEGIN(bugprone-macro-parentheses): tmp is a name being declared and
// lhs may be a declaration (`auto x`); parentheses would not compile.
#define PSLD_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()
// NOLINTEND(bugprone-macro-parentheses)

// `PSLD_ASSIGN_OR_RETURN(auto x, make_x());` declares x from a Result or
// returns its error.
#define PSLD_ASSIGN_OR_RETURN(lhs, expr) \
  PSLD_ASSIGN_OR_RETURN_IMPL_(PSLD_CONCAT_(psld_result_, __LINE__), lhs, expr)
