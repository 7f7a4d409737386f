#include "psld/status.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

namespace psld {
namespace {

TEST(Status, OkIsDefaultAndCarriesNoMessage) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.to_string(), "OK");
  EXPECT_EQ(s, Status::Ok());
}

TEST(Status, ErrorKeepsCodeAndMessage) {
  Status s = InvalidArgument("chunk_bytes must be at least 1");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "chunk_bytes must be at least 1");
  EXPECT_EQ(s.to_string(), "InvalidArgument: chunk_bytes must be at least 1");
}

TEST(Status, ConstructingWithOkCodeIsOk) {
  Status s(StatusCode::kOk, "ignored");
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.message(), "");
}

TEST(Status, CopyIsDeepAndMoveLeavesUsableSource) {
  Status a = Timeout("pull of key 7 timed out after 5000 ms");
  Status b = a;
  EXPECT_EQ(a, b);
  Status c = std::move(a);
  EXPECT_EQ(c, b);
  a = b;  // a moved-from status can be assigned again
  EXPECT_EQ(a.code(), StatusCode::kTimeout);
  b = Status::Ok();
  EXPECT_TRUE(b.ok());
  EXPECT_EQ(a.code(), StatusCode::kTimeout);  // assigning b did not touch a's copy
}

TEST(Status, WithContextPrefixesErrorsOnly) {
  EXPECT_TRUE(Status::Ok().with_context("server 3").ok());
  Status s = Unavailable("peer closed the connection").with_context("server 3");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "server 3: peer closed the connection");
}

TEST(Status, EveryCodeHasAName) {
  for (int c = 0; c <= static_cast<int>(StatusCode::kInternal); ++c) {
    auto name = status_code_name(static_cast<StatusCode>(c));
    EXPECT_FALSE(name.empty());
    EXPECT_NE(name, "Unknown") << c;
  }
  EXPECT_EQ(status_code_name(StatusCode::kMoved), "Moved");
}

Result<int> parse_positive(int v) {
  if (v <= 0) return OutOfRange("value must be positive, got " + std::to_string(v));
  return v;
}

Result<int> doubled(int v) {
  PSLD_ASSIGN_OR_RETURN(int x, parse_positive(v));
  return 2 * x;
}

Status check_both(int a, int b) {
  PSLD_RETURN_IF_ERROR(parse_positive(a).status());
  PSLD_RETURN_IF_ERROR(parse_positive(b).status().with_context("second"));
  return Status::Ok();
}

TEST(Result, HoldsValueOrError) {
  Result<int> ok = parse_positive(4);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 4);
  EXPECT_TRUE(ok.status().ok());

  Result<int> bad = parse_positive(-1);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(bad.value_or(9), 9);
}

TEST(Result, MacrosPropagateErrors) {
  EXPECT_EQ(*doubled(21), 42);
  EXPECT_EQ(doubled(0).status().code(), StatusCode::kOutOfRange);
  EXPECT_TRUE(check_both(1, 2).ok());
  Status s = check_both(1, -2);
  EXPECT_EQ(s.message(), "second: value must be positive, got -2");
}

TEST(Result, OkStatusWithoutValueBecomesInternalError) {
  Result<int> r{Status::Ok()};
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(Result, MoveOnlyValues) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(5);
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 5);
}

}  // namespace
}  // namespace psld
