// Dataset index helpers for megazoo.data (GPT sample index, weighted blending).
//
// Both functions return arrays identical to the NumPy fallbacks in
// megazoo/data/helpers.py; tests/test_data_helpers.py checks that on random inputs.
// The Python wrappers validate and convert inputs (int64 / float64, C-contiguous,
// normalised weights) before calling in here, so this file only re-checks bounds.
//
// Build flags: -O3 -ffp-contract=off. The second flag matters: blending compares
// `w * t - c` between datasets, and a fused multiply-add rounds differently from
// the two roundings Python performs, which could flip a near-tie.
//
// Module name: TORCH_EXTENSION_NAME when built by torch.utils.cpp_extension,
// otherwise `_data_helpers` (so setup.py can build it as megazoo._data_helpers).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _data_helpers
#endif

namespace py = pybind11;

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using F64Array = py::array_t<double, py::array::c_style | py::array::forcecast>;

// Sample k (k >= 1) ends at global token position k * seq_length of the
// epoch-concatenated document stream doc_idx. Row k holds the index into doc_idx of
// the first document whose end lies beyond that position (zero-length documents are
// therefore skipped) and the offset of the position inside it. Row 0 is (0, 0).
static I64Array build_sample_idx(const I64Array& sizes, const I64Array& doc_idx,
                                 int64_t seq_length, int64_t num_epochs,
                                 int64_t tokens_per_epoch) {
  if (seq_length <= 0 || num_epochs <= 0 || tokens_per_epoch <= 0) {
    throw std::invalid_argument(
        "seq_length, num_epochs and tokens_per_epoch must be positive");
  }
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;
  const int64_t num_sizes = sizes.shape(0);
  const int64_t num_docs = doc_idx.shape(0);
  const int64_t* sz = sizes.data();
  const int64_t* docs = doc_idx.data();

  I64Array result({num_samples + 1, static_cast<int64_t>(2)});
  int64_t* out = result.mutable_data();
  bool ran_out = false;
  {
    py::gil_scoped_release release;
    out[0] = 0;
    out[1] = 0;
    int64_t pos = 0;                       // index into doc_idx
    int64_t doc_start = 0;                 // global position of its first token
    int64_t doc_end = 0;                   // global position one past its last token
    bool have_doc = false;
    for (int64_t k = 1; k <= num_samples && !ran_out; ++k) {
      const int64_t target = k * seq_length;
      while (!have_doc || doc_end <= target) {
        if (have_doc) ++pos;
        if (pos >= num_docs) { ran_out = true; break; }
        const int64_t doc = docs[pos];
        if (doc < 0 || doc >= num_sizes) { ran_out = true; break; }
        doc_start = doc_end;
        doc_end += sz[doc];
        have_doc = true;
      }
      out[2 * k] = pos;
      out[2 * k + 1] = target - doc_start;
    }
  }
  if (ran_out) {
    throw std::out_of_range(
        "doc_idx holds fewer tokens than num_epochs * tokens_per_epoch, or a document "
        "id outside sizes");
  }
  return result;
}

// Greedy blending: sample t goes to the dataset whose share is furthest behind its
// weight, i.e. argmax_i (w_i * max(t, 1) - count_i), ties to the lowest index.
static py::tuple build_blending_indices(const F64Array& weights, int64_t size) {
  const int64_t n = weights.shape(0);
  if (n <= 0 || size < 0) {
    throw std::invalid_argument("need at least one weight and a non-negative size");
  }
  const double* w = weights.data();
  py::array_t<int32_t> dataset_index(size);
  py::array_t<int64_t> dataset_sample_index(size);
  int32_t* di = dataset_index.mutable_data();
  int64_t* dsi = dataset_sample_index.mutable_data();
  {
    py::gil_scoped_release release;
    std::vector<int64_t> counts(static_cast<size_t>(n), 0);
    for (int64_t t = 0; t < size; ++t) {
      const double td = t > 0 ? static_cast<double>(t) : 1.0;
      int64_t best = 0;
      double best_err = w[0] * td - static_cast<double>(counts[0]);
      for (int64_t i = 1; i < n; ++i) {
        const double err = w[i] * td - static_cast<double>(counts[i]);
        if (err > best_err) {
          best_err = err;
          best = i;
        }
      }
      di[t] = static_cast<int32_t>(best);
      dsi[t] = counts[best];
      ++counts[best];
    }
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megazoo dataset index helpers (C++ versions of megazoo.data.helpers)";
  m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"));
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"),
        py::arg("size"));
}
