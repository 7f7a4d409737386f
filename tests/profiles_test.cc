#include "bench/profiles.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

namespace psld::bench {
namespace {

uint64_t total_elements(const std::vector<TensorSpec>& specs) {
  return std::accumulate(specs.begin(), specs.end(), uint64_t{0},
                         [](uint64_t sum, const TensorSpec& t) { return sum + t.elements; });
}

const TensorSpec& largest(const std::vector<TensorSpec>& specs) {
  return *std::max_element(
      specs.begin(), specs.end(),
      [](const TensorSpec& a, const TensorSpec& b) { return a.elements < b.elements; });
}

// The published figures: sum(p.numel()) and len(list(model.parameters())) in
// torchvision / transformers (docs/profiles.md).
TEST(Profiles, ResNet50MatchesTorchvision) {
  auto specs = load_profile("resnet50");
  ASSERT_TRUE(specs.ok()) << specs.status().to_string();
  EXPECT_EQ(specs->size(), 161u);
  EXPECT_EQ(total_elements(*specs), 25'557'032u);
  EXPECT_EQ(specs->front().name, "conv1.weight");
  EXPECT_EQ(specs->front().shape, (std::vector<uint64_t>{64, 3, 7, 7}));
  EXPECT_EQ(specs->front().elements, 9408u);
  EXPECT_EQ(specs->back().name, "fc.bias");
  EXPECT_EQ(largest(*specs).elements, 2'359'296u);  // each 512x512x3x3 conv2 of layer4
}

TEST(Profiles, Vgg16MatchesTorchvision) {
  auto specs = load_profile("vgg16");
  ASSERT_TRUE(specs.ok()) << specs.status().to_string();
  EXPECT_EQ(specs->size(), 32u);
  EXPECT_EQ(total_elements(*specs), 138'357'544u);
  const TensorSpec& fc6 = largest(*specs);
  EXPECT_EQ(fc6.name, "classifier.0.weight");
  EXPECT_EQ(fc6.shape, (std::vector<uint64_t>{4096, 25088}));  // PyTorch's (out, in)
  EXPECT_EQ(fc6.elements, 102'760'448u);
  EXPECT_EQ(fc6.elements * 4, 392u << 20);  // 392 MiB in fp32
}

TEST(Profiles, BertBaseMatchesTransformers) {
  auto specs = load_profile("bert_base");
  ASSERT_TRUE(specs.ok()) << specs.status().to_string();
  EXPECT_EQ(specs->size(), 199u);
  EXPECT_EQ(total_elements(*specs), 109'482'240u);
  EXPECT_EQ(specs->front().name, "embeddings.word_embeddings.weight");
  EXPECT_EQ(specs->front().shape, (std::vector<uint64_t>{30522, 768}));
  EXPECT_EQ(largest(*specs).name, "embeddings.word_embeddings.weight");
  EXPECT_EQ(specs->back().name, "pooler.dense.bias");
}

// The header comment states the totals too; it must agree with the lines.
TEST(Profiles, HeaderCommentAgreesWithTheTensors) {
  for (const char* name : {"resnet50", "vgg16", "bert_base"}) {
    SCOPED_TRACE(name);
    auto specs = load_profile(name);
    ASSERT_TRUE(specs.ok()) << specs.status().to_string();
    std::ifstream in(profiles_dir() + "/" + name + ".tsv");
    std::string header;
    ASSERT_TRUE(std::getline(in, header));
    const uint64_t total = total_elements(*specs);
    EXPECT_EQ(header.rfind("# source: ", 0), 0u) << header;
    EXPECT_NE(header.find("; parameters: " + std::to_string(total) + ";"), std::string::npos)
        << header;
    EXPECT_NE(header.find("; bytes fp32: " + std::to_string(4 * total)), std::string::npos)
        << header;
  }
}

TEST(Profiles, PathAndNameLoadTheSameProfile) {
  auto by_name = load_profile("vgg16");
  auto by_path = load_profile(profiles_dir() + "/vgg16.tsv");
  ASSERT_TRUE(by_name.ok()) << by_name.status().to_string();
  ASSERT_TRUE(by_path.ok()) << by_path.status().to_string();
  ASSERT_EQ(by_name->size(), by_path->size());
  for (size_t i = 0; i < by_name->size(); ++i) {
    EXPECT_EQ((*by_name)[i].name, (*by_path)[i].name);
    EXPECT_EQ((*by_name)[i].shape, (*by_path)[i].shape);
  }
}

TEST(Profiles, SkipsCommentsBlankLinesAndCarriageReturns) {
  auto specs = parse_profile("# header\n\nw\t2x3\t6\r\n# middle\nb\t3\t3", "t.tsv");
  ASSERT_TRUE(specs.ok()) << specs.status().to_string();
  ASSERT_EQ(specs->size(), 2u);
  EXPECT_EQ((*specs)[0].name, "w");
  EXPECT_EQ((*specs)[0].shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ((*specs)[0].elements, 6u);
  EXPECT_EQ((*specs)[1].name, "b");
  EXPECT_EQ((*specs)[1].shape, (std::vector<uint64_t>{3}));
}

// Each malformed line is an InvalidArgument that points at file:line.
struct BadLine {
  const char* line;
  const char* says;
};

TEST(Profiles, MalformedLinesNameFileAndLine) {
  const BadLine cases[] = {
      {"w\t2x3", "expected 3 tab-separated fields (name, shape, elements), found 2"},
      {"w\t2x3\t6\textra", "found 4"},
      {"w 2x3 6", "found 1"},
      {"\t2x3\t6", "tensor name '' is empty"},
      {"my w\t2x3\t6", "contains whitespace"},
      {"w\t\t6", "bad shape ''"},
      {"w\t2x\t2", "bad shape '2x'"},
      {"w\tx2\t2", "bad shape 'x2'"},
      {"w\t2xx3\t6", "bad shape '2xx3'"},
      {"w\t2x0\t0", "bad shape '2x0'"},
      {"w\t-2\t2", "bad shape '-2'"},
      {"w\t2*3\t6", "bad shape '2*3'"},
      {"w\t2 x 3\t6", "bad shape '2 x 3'"},
      {"w\t4294967296x4294967296\t0", "more than 2^64 elements"},
      {"w\t2x3\t", "bad element count ''"},
      {"w\t2x3\tsix", "bad element count 'six'"},
      {"w\t2x3\t6.0", "bad element count '6.0'"},
      {"w\t2x3\t7", "w has 7 elements, but its shape 2x3 holds 6"},
  };
  for (const BadLine& c : cases) {
    SCOPED_TRACE(c.line);
    auto specs = parse_profile(std::string("# header\nok\t1\t1\n") + c.line + "\n", "m.tsv");
    ASSERT_FALSE(specs.ok());
    EXPECT_EQ(specs.status().code(), StatusCode::kInvalidArgument);
    const std::string message = specs.status().message();
    EXPECT_EQ(message.rfind("m.tsv:3: ", 0), 0u) << message;
    EXPECT_NE(message.find(c.says), std::string::npos) << message;
  }
}

TEST(Profiles, DuplicateNameIsAnError) {
  auto specs = parse_profile("a\t1\t1\nb\t1\t1\na\t2\t2\n", "d.tsv");
  ASSERT_FALSE(specs.ok());
  EXPECT_EQ(specs.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(specs.status().message(), "d.tsv:3: tensor a appears twice (first on line 1)");
}

TEST(Profiles, EmptyProfileIsAnError) {
  auto specs = parse_profile("# only a comment\n\n", "e.tsv");
  ASSERT_FALSE(specs.ok());
  EXPECT_EQ(specs.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(specs.status().message(), "e.tsv: the profile lists no tensors");
}

class TempFile {
 public:
  explicit TempFile(const std::string& text)
      : path_(::testing::TempDir() + "profiles_test_" + std::to_string(::getpid()) + ".tsv") {
    std::ofstream(path_) << text;
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(Profiles, MalformedFileReportsItsPathAndLine) {
  TempFile file("# a profile\nw\t2x3\t6\nb\t3x\t3\n");
  auto specs = load_profile(file.path());
  ASSERT_FALSE(specs.ok());
  EXPECT_EQ(specs.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(specs.status().message().rfind(file.path() + ":3: bad shape '3x'", 0), 0u)
      << specs.status().message();
}

TEST(Profiles, MissingFileIsNotFoundNamingThePath) {
  const std::string path = ::testing::TempDir() + "no_such_profile_dir/model.tsv";
  auto specs = load_profile(path);
  ASSERT_FALSE(specs.ok());
  EXPECT_EQ(specs.status().code(), StatusCode::kNotFound);
  EXPECT_NE(specs.status().message().find(path), std::string::npos) << specs.status().message();
}

TEST(Profiles, UnknownNameIsNotFoundNamingTheShippedDirectory) {
  auto specs = load_profile("resnet5");
  ASSERT_FALSE(specs.ok());
  EXPECT_EQ(specs.status().code(), StatusCode::kNotFound);
  const std::string message = specs.status().message();
  EXPECT_NE(message.find(profiles_dir() + "/resnet5.tsv"), std::string::npos) << message;
  EXPECT_NE(message.find("resnet50, vgg16, bert_base"), std::string::npos) << message;
}

TEST(Profiles, DirectoryAndEmptyNameAreInvalid) {
  auto dir = load_profile(profiles_dir() + "/");
  ASSERT_FALSE(dir.ok());
  EXPECT_EQ(dir.status().code(), StatusCode::kInvalidArgument) << dir.status().to_string();
  auto empty = load_profile("");
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace psld::bench
