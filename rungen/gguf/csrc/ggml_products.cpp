// The products' torch side: each weight's rows spread over torch's threads to the code path's kernels, the
// activations quantized once for them, the de-quantized form (dequantize, embed, the float tiles).
#include "ggml_ops.h"

namespace rungen_ggml {
namespace {

using RowsFn = void (*)(const Job&, int64_t, int64_t);

RowsFn rows_fn(int64_t qtype) {
  const bool x8 = qtype & X8;
  switch (current_isa) {
    case AMX:
    case VNNI: return x8 ? vnni::x8_rows : vnni::rows;
    case AVX2: return x8 ? avx2::x8_rows : avx2::rows;
    default: return x8 ? scalar::x8_rows : scalar::rows;
  }
}

}  // namespace

// Output rows of a weight's blocks (a tensor row holds eight of them in the X8 layout).
int64_t out_rows(const at::Tensor& blocks, int64_t qtype) { return blocks.size(0) * (qtype & X8 ? 8 : 1); }

void check_inputs(const at::Tensor& blocks, int64_t qtype, int64_t in_features) {
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 2, "rungen_ggml: blocks must be uint8 [rows, bytes]");
  TORCH_CHECK(!(qtype & X8) || interleaved_type(qtype & ~X8), "rungen_ggml: only Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
              "Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS and MXFP4 rows are interleaved");
  TORCH_CHECK(in_features % block_elements(qtype) == 0, "rungen_ggml: in_features ", in_features,
              " is not a multiple of the block size");
  const int64_t bytes = in_features / block_elements(qtype) * (qtype & X8 ? x8_bytes(qtype & ~X8) : block_bytes(qtype));
  TORCH_CHECK(blocks.size(1) == bytes, "rungen_ggml: blocks have ", blocks.size(1), " bytes a row, expected ", bytes);
  TORCH_CHECK(blocks.stride(1) == 1, "rungen_ggml: each row of blocks must be contiguous");
  TORCH_CHECK(blocks.device().is_cpu(), "rungen_ggml: blocks must be on the CPU");
}

// A weight's blocks as the grouped products read them (checked by check_inputs first).
Weight weight_of(const at::Tensor& blocks, int64_t qtype) {
  return Weight{blocks.data_ptr<uint8_t>(), blocks.stride(0), blocks.size(0), qtype};
}

namespace {

// Quantizes x [n, K] to int8 per block of 32: d = max|x| / 127, q = round(x / d) (ties to even). The codes
// and scales live in one buffer per calling thread, reused from call to call (no allocation a step).
struct QuantizedX {
  std::vector<float> buffer;
  Act act;
};

void quantize_into(QuantizedX& r, const float* xp, int64_t n, int64_t k) {
  const int64_t nb = k / 32;
  // d, s, s16 (2), s4, sum (int32), sum16, high16 and off16 (int32, 2 each), then the codes, which start on a cache
  // line (64 bytes), and on the AVX2 path the biased codes u, from the next line after them.
  const bool biased = current_isa == AVX2;
  const size_t floats = size_t(n * nb * 12) + (biased ? 2 : 1) * (size_t(n * k + 3) / 4 + 16);
  if (r.buffer.size() < floats) r.buffer.resize(floats);
  const auto line = [](float* p) { return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63)); };
  float* d = r.buffer.data();
  float* s = d + n * nb;
  float* s16 = s + n * nb;
  float* s4 = s16 + 2 * n * nb;
  int32_t* off128 = reinterpret_cast<int32_t*>(s4 + n * nb);
  int32_t* sum16 = off128 + n * nb;
  int32_t* high16 = sum16 + 2 * n * nb;
  int32_t* off16 = high16 + 2 * n * nb;
  int8_t* q = reinterpret_cast<int8_t*>(line(s4 + 8 * n * nb));
  uint8_t* u = biased ? reinterpret_cast<uint8_t*>(line(reinterpret_cast<float*>(q + n * k))) : nullptr;
  const auto blocks_fn = current_isa >= VNNI ? vnni::quantize_blocks
                        : current_isa == AVX2 ? avx2::quantize_blocks
                                              : scalar::quantize_blocks;
  at::parallel_for(0, n * nb, 128, [&](int64_t b0, int64_t b1) {
    blocks_fn(xp, b0, b1, q, u, d, s, s16, off128, sum16, high16, off16);
  });
  for (int64_t g = 0; g < n / 4; ++g)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t i = 0; i < 4; ++i) s4[(g * nb + b) * 4 + i] = s[(4 * g + i) * nb + b];
  r.act = Act{n, q, d, s, s16, s4, off128, sum16, high16, off16, u};
}

// Enough rows a task that a thread's share is worth waking it for (about 64k multiply-adds).
int64_t grain_of(int64_t in_features, int64_t n, int64_t per) {
  return std::max<int64_t>(1, 65536 / (in_features * n * per));
}

// Every job's rows [starts[j], starts[j + 1]) of one loop over torch's threads.
void run_jobs(const std::vector<Job>& jobs, const std::vector<RowsFn>& fns, const std::vector<int64_t>& starts,
              int64_t grain) {
  at::parallel_for(0, starts.back(), grain, [&](int64_t r0, int64_t r1) {
    for (size_t j = 0; j < jobs.size(); ++j) {
      const int64_t a = std::max(r0, starts[j]), b = std::min(r1, starts[j + 1]);
      if (a < b) fns[j](jobs[j], a - starts[j], b - starts[j]);
    }
  });
}

// y [n, width] = x [n, K] times each part's rows (blocks[i] of type qtypes[i]) side by side, part i's outputs in
// the columns after part i - 1's: projections of one input whose weights differ in block type (q/k/v, gate/up
// of a Q4_K_M file) as one product. The activations are quantized once for all parts, and one parallel loop
// covers every part's rows. Job.out_features is y's row stride, so a part writes straight into its own columns;
// each row is the kernel's own arithmetic, so its bits are those of the part multiplied alone. A part of zero
// rows (the callers' padding to a fixed number of parts) costs nothing.
void products_into(const float* x, int64_t n, at::TensorList blocks, at::IntArrayRef qtypes, int64_t in_features,
                   float* y) {
  std::vector<Weight> parts;
  int64_t width = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    parts.push_back(weight_of(blocks[i], qtypes[i]));
    width += out_rows(blocks[i], qtypes[i]);
  }
  grouped_into(x, in_features, {n}, {parts}, width, y);  // (one group: every part over all n rows)
}

// y [n, out rows] = x [n, K] times the blocks' rows, by the integer kernels (y may be any buffer of that size).
void product_into(const float* x, int64_t n, const at::Tensor& blocks, int64_t qtype, int64_t in_features, float* y) {
  products_into(x, n, at::TensorList(blocks), at::IntArrayRef(qtype), in_features, y);
}

}  // namespace

at::Tensor mm_int(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t in_features) {
  check_inputs(blocks, qtype, in_features);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == in_features, "rungen_ggml: x must be [n, ", in_features, "]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), out_rows(blocks, qtype)}, x.options());
  product_into(x.data_ptr<float>(), x.size(0), blocks, qtype, in_features, y.data_ptr<float>());
  return y;
}

namespace {

void dequantize_rows(const uint8_t* blocks, int64_t pitch, int64_t qtype, int64_t k, int64_t r0, int64_t r1,
                     float* out) {
  if (qtype & X8) {
    const int64_t base = qtype & ~X8, bytes = x8_bytes(base);
    const bool offsets = x8_offsets(base);
    int32_t codes[32], sc[2];
    float d, m;
    for (int64_t r = r0; r < r1; ++r) {
      float* o = out + (r - r0) * k;
      for (int64_t b = 0; b < k / 32; ++b) {
        if (x8_super(base)) {
          // As the row-major path (and the gguf package): (d * scale) * code + offset.
          kx8_block(blocks + (r / 8) * pitch + b / 8 * bytes, base, r % 8, b % 8, codes, sc, d, m);
          for (int i = 0; i < 32; ++i) {
            const float w = (d * float(sc[i / 16])) * float(codes[i]);
            o[b * 32 + i] = offsets ? w + m : w;
          }
          continue;
        }
        x8_block(blocks + (r / 8) * pitch + b * bytes, base, r % 8, codes, d, m);
        for (int i = 0; i < 32; ++i) o[b * 32 + i] = offsets ? d * float(codes[i]) + m : d * float(codes[i]);
      }
    }
    return;
  }
  const int64_t bytes = block_bytes(qtype), elements = block_elements(qtype);
  const bool unpacked = krow_type(qtype);
  const int kind = code_kind(qtype), center = code_center(qtype);
  KRow kr(unpacked ? k : 0);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = blocks + r * pitch;
    float* o = out + (r - r0) * k;
    if (unpacked) {
      for (int64_t s = 0; s < k / elements; ++s) unpack_block(qtype, row + s * bytes, kr, s);
      // As the gguf package computes it: (d * scale) * code + offset, or for centred and signed codes
      // (d * scale) * (code - center) (sc16 is 1 where a type has no integer scales: the product is exact).
      for (int64_t i = 0; i < k; ++i) {
        const int64_t j16 = i / 16;
        const float w = kr.wd[i / 32] * float(kr.sc16[j16]);
        if (kind == SIGNED)
          o[i] = w * float(int8_t(kr.codes[i]));
        else if (center)
          o[i] = w * float(int32_t(kr.codes[i]) - center);
        else
          o[i] = w * float(kr.codes[i]) + kr.wm[j16];
      }
      continue;
    }
    for (int64_t b = 0; b < k / 32; ++b) {
      const uint8_t* p = row + b * bytes;
      const float d = half_bits_to_float(p);
      if (qtype == Q8_0) {
        const int8_t* q = (const int8_t*)(p + 2);
        for (int i = 0; i < 32; ++i) o[b * 32 + i] = d * float(q[i]);
        continue;
      }
      const float m = qtype == Q4_1 ? half_bits_to_float(p + 2) : -8.f * d;
      const uint8_t* qs = p + bytes - 16;
      for (int i = 0; i < 16; ++i) {
        o[b * 32 + i] = d * float(qs[i] & 0x0F) + m;
        o[b * 32 + 16 + i] = d * float(qs[i] >> 4) + m;
      }
    }
  }
}

}  // namespace

at::Tensor dequantize(const at::Tensor& blocks, int64_t qtype, int64_t in_features) {
  check_inputs(blocks, qtype, in_features);
  const int64_t out = out_rows(blocks, qtype);
  at::Tensor w = at::empty({out, in_features}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, out, std::max<int64_t>(1, 16384 / in_features), [&](int64_t r0, int64_t r1) {
    dequantize_rows(bp, blocks.stride(0), qtype, in_features, r0, r1, wp + r0 * in_features);
  });
  return w;
}

namespace {

// Tokens from which a product goes through de-quantized float tiles and torch's matmul rather than the
// integer kernel. Off by default: the tiles are slower than the interleaved integer kernel at every size
// measured (docs/kernels.md), and their float sums come in another order, while a token's product must not
// depend on how many others share the call (a greedy sequence would change with its batch). Settable for
// benchmarks (benchmarks.perplexity's unrounded activations).
int64_t tile_threshold = std::numeric_limits<int64_t>::max();

}  // namespace

at::Tensor mm_tiled(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t in_features) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t out = out_rows(blocks, qtype);
  // y.T = W @ x.T, a tile of W's rows at a time (about 4 MB of float32), each tile's rows of y.T contiguous.
  at::Tensor yt = at::empty({out, x.size(0)}, x.options());
  const int64_t tile = std::max<int64_t>(16, (int64_t(1) << 20) / in_features);
  at::Tensor w = at::empty({std::min(tile, out), in_features}, x.options());
  const at::Tensor xt = x.t();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  for (int64_t r0 = 0; r0 < out; r0 += tile) {
    const int64_t r1 = std::min(out, r0 + tile);
    float* wp = w.data_ptr<float>();
    at::parallel_for(r0, r1, std::max<int64_t>(1, 16384 / in_features), [&](int64_t a, int64_t b) {
      dequantize_rows(bp, blocks.stride(0), qtype, in_features, a, b, wp + (a - r0) * in_features);
    });
    at::Tensor dst = yt.narrow(0, r0, r1 - r0);
    at::mm_out(dst, w.narrow(0, 0, r1 - r0), xt);
  }
  return yt.t().contiguous();
}

namespace {

// x [n, K] with each block of 32 rounded as quantize_into rounds it (d = max|x| / 127, q = round(x / d)),
// given back as q * d in float32.
at::Tensor rounded_activations(const at::Tensor& x_in) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor r = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* rp = r.data_ptr<float>();
  at::parallel_for(0, x.numel() / 32, 128, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* v = xp + b * 32;
      float* o = rp + b * 32;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float scale = amax / 127.f;
      const float inv = scale != 0.f ? 1.f / scale : 0.f;
      for (int i = 0; i < 32; ++i) o[i] = float(int32_t(std::nearbyint(v[i] * inv))) * scale;
    }
  });
  return r;
}

}  // namespace

// x [n, K] (float32, contiguous) times the parts' rows side by side (products_into) into y, a buffer of
// [n, all their rows]: the integer kernel, or from tile_threshold tokens float tiles, their activations rounded as
// the integer kernel rounds them (a token's product is then the same, up to the order of float sums, alone, in a
// batch of any size and in a prompt, so a greedy sequence does not change with the batch it decodes in).
void mm_parts_into(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef qtypes, int64_t in_features,
                   float* y) {
  TORCH_CHECK(blocks.size() == qtypes.size() && !blocks.empty(), "rungen_ggml: one type for each part's blocks");
  int64_t width = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    check_inputs(blocks[i], qtypes[i], in_features);
    width += out_rows(blocks[i], qtypes[i]);
  }
  const int64_t n = x.size(0);
  if (n >= tile_threshold) {
    const at::Tensor rounded = rounded_activations(x);
    int64_t column = 0;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const int64_t out = out_rows(blocks[i], qtypes[i]);
      if (out == 0) continue;
      const at::Tensor r = mm_tiled(rounded, blocks[i], qtypes[i], in_features);
      const float* rp = r.data_ptr<float>();
      for (int64_t t = 0; t < n; ++t) std::memcpy(y + t * width + column, rp + t * out, out * sizeof(float));
      column += out;
    }
    return;
  }
  products_into(x.data_ptr<float>(), n, blocks, qtypes, in_features, y);
}

void mm_into(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t in_features, float* y) {
  mm_parts_into(x, at::TensorList(blocks), at::IntArrayRef(qtype), in_features, y);
}

at::Tensor mm(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t in_features) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == in_features, "rungen_ggml: x must be [n, ", in_features, "]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), out_rows(blocks, qtype)}, x.options());
  mm_into(x, blocks, qtype, in_features, y.data_ptr<float>());
  return y;
}

// Output features of parts side by side.
int64_t parts_rows(at::TensorList blocks, at::IntArrayRef qtypes) {
  TORCH_CHECK(blocks.size() == qtypes.size(), "rungen_ggml: one type for each part's blocks");
  int64_t rows = 0;
  for (size_t i = 0; i < blocks.size(); ++i) rows += out_rows(blocks[i], qtypes[i]);
  return rows;
}

// x [n, K] times the parts' rows side by side: [n, all their rows] (mm_parts_into).
at::Tensor mm_parts(const at::Tensor& x_in, at::TensorList blocks, at::IntArrayRef qtypes, int64_t in_features) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == in_features, "rungen_ggml: x must be [n, ", in_features, "]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), parts_rows(blocks, qtypes)}, x.options());
  mm_parts_into(x, blocks, qtypes, in_features, y.data_ptr<float>());
  return y;
}

// x [N, K] (float32) in groups of rows (counts[g] rows each, in order), group g times its parts' rows side by side
// (weights[g]: one Weight a part, each group's parts of the same widths): y [N, width]. A mixture's experts, each
// over the tokens routed to it, in one loop over torch's threads where a product an expert woke them each time.
// Each group's activations are quantized on their own, so its rows' bits are those of mm over that group alone (a
// group of no rows costs nothing). The quantized activations live in buffers kept from call to call.
void grouped_into(const float* x, int64_t in_features, const std::vector<int64_t>& counts,
                  const std::vector<std::vector<Weight>>& weights, int64_t width, float* y) {
  static thread_local std::vector<QuantizedX> acts;
  if (acts.size() < counts.size()) acts.resize(counts.size());  // (before any job points into them)
  std::vector<Job> jobs;
  std::vector<RowsFn> fns;
  std::vector<int64_t> starts{0};
  int64_t row = 0, most = 1, per = 1;
  for (size_t g = 0; g < counts.size(); ++g) {
    if (counts[g] == 0) continue;
    const size_t first = jobs.size();
    int64_t column = 0;
    for (const Weight& w : weights[g]) {
      if (w.rows == 0) continue;  // (a part of zero rows, the callers' padding to a fixed number of parts)
      jobs.push_back(Job{&acts[g].act, w.blocks, w.pitch, w.qtype, in_features, width, y + row * width + column});
      fns.push_back(rows_fn(w.qtype));
      starts.push_back(starts.back() + w.rows);
      if (w.qtype & X8) per = 8;  // X8 tasks are groups of eight rows
      column += w.rows * (w.qtype & X8 ? 8 : 1);
    }
    if (jobs.size() > first) quantize_into(acts[g], x + row * in_features, counts[g], in_features);
    most = std::max(most, counts[g]);
    row += counts[g];
  }
  if (!jobs.empty()) run_jobs(jobs, fns, starts, grain_of(in_features, most, per));
}

// x [N, K] in groups of rows (counts[g] rows each, in order), group g times blocks[g]'s rows (qtypes[g]), the
// weights of one shape: y [N, out rows] (grouped_into).
at::Tensor mm_grouped(const at::Tensor& x_in, at::TensorList blocks, at::IntArrayRef qtypes, at::IntArrayRef counts,
                      int64_t in_features) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == in_features, "rungen_ggml: x must be [n, ", in_features, "]");
  TORCH_CHECK(!blocks.empty() && blocks.size() == qtypes.size() && blocks.size() == counts.size(),
              "rungen_ggml: one type and one count of rows for each group's blocks");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t out = out_rows(blocks[0], qtypes[0]);
  int64_t total = 0;
  std::vector<std::vector<Weight>> weights;
  for (size_t g = 0; g < blocks.size(); ++g) {
    check_inputs(blocks[g], qtypes[g], in_features);
    TORCH_CHECK(out_rows(blocks[g], qtypes[g]) == out, "rungen_ggml: mm_grouped's weights must have one shape");
    TORCH_CHECK(counts[g] >= 0, "rungen_ggml: a group's count of rows is negative");
    total += counts[g];
    weights.push_back({weight_of(blocks[g], qtypes[g])});
  }
  TORCH_CHECK(total == x.size(0), "rungen_ggml: the groups' counts add up to ", total, ", not x's ", x.size(0), " rows");
  at::Tensor y = at::empty({total, out}, x.options());
  grouped_into(x.data_ptr<float>(), in_features, std::vector<int64_t>(counts.begin(), counts.end()), weights, out,
               y.data_ptr<float>());
  return y;
}

// The rows `ids` of a weight's blocks (either layout), de-quantized: an embedding's lookup [ids, in_features].
at::Tensor embed(const at::Tensor& blocks, int64_t qtype, int64_t in_features, const at::Tensor& ids_in) {
  check_inputs(blocks, qtype, in_features);
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n = ids.numel(), rows = out_rows(blocks, qtype);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "rungen_ggml: embed: id ", ip[i], " is not below ", rows);
  at::Tensor out = at::empty({n, in_features}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / in_features), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      dequantize_rows(bp, blocks.stride(0), qtype, in_features, ip[i], ip[i] + 1, op + i * in_features);
  });
  return out;
}

int64_t set_tile_threshold(int64_t n) {
  const int64_t old = tile_threshold;
  tile_threshold = n;
  return old;
}

}  // namespace rungen_ggml
