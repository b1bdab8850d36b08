// A weight's blocks rearranged into the X8 layout (ggml_formats.h) once, at load; MXFP4's held as IQ4_NL's.
#include <atomic>

#include "ggml_ops.h"

namespace rungen_ggml {
namespace {

// Group g's superblocks of k-quant rows (pitch bytes apart from src) in the X8 layout at dst (see X8).
void interleave_kquant(const uint8_t* src, int64_t pitch, int64_t qtype, int64_t nsb, int64_t g, uint8_t* dst,
                       KRow& kr) {
  const int64_t bytes = block_bytes(qtype), block = qtype == Q6_K ? 192 : qtype == Q5_K ? 160 : 128;
  for (int64_t s = 0; s < nsb; ++s) {
    uint8_t* o = dst + (g * nsb + s) * x8_bytes(qtype);
    uint8_t* codes_out = o + (qtype == Q6_K ? 144 : 160);
    for (int64_t r = 0; r < 8; ++r) {
      const uint8_t* sb = src + (8 * g + r) * pitch + s * bytes;
      unpack_k(qtype, sb, kr, 0);
      const uint8_t* c = kr.codes;
      if (qtype == Q6_K) {
        std::memcpy(o + 2 * r, sb + 208, 2);
        for (int h = 0; h < 16; ++h) o[16 + 8 * h + r] = sb[192 + h];
      } else {
        uint8_t sc[8], mn[8];
        kquant_scales(sb + 4, sc, mn);
        std::memcpy(o + 2 * r, sb, 2);
        std::memcpy(o + 16 + 2 * r, sb + 2, 2);
        for (int j = 0; j < 8; ++j) {
          o[32 + 8 * j + r] = sc[j];
          o[96 + 8 * j + r] = mn[j];
        }
      }
      for (int j = 0; j < 8; ++j) {
        const uint8_t* cj = c + 32 * j;
        uint8_t* nib = codes_out + block * j;
        for (int k = 0; k < 4; ++k)
          for (int i = 0; i < 4; ++i)
            nib[32 * k + 4 * r + i] = (cj[4 * k + i] & 0x0F) | ((cj[16 + 4 * k + i] & 0x0F) << 4);
        uint8_t* high = nib + 128 + 4 * r;
        for (int i = 0; i < 4 && qtype != Q4_K; ++i) {
          uint8_t first = 0, second = 0;
          for (int k = 0; k < 4; ++k) {
            const int lo = cj[4 * k + i] >> 4, hi = cj[16 + 4 * k + i] >> 4;
            if (qtype == Q5_K) {
              first |= (lo << k) | (hi << (4 + k));
            } else {
              first |= lo << (2 * k);
              second |= hi << (2 * k);
            }
          }
          high[i] = first;
          if (qtype == Q6_K) high[32 + i] = second;
        }
      }
    }
  }
}

// Group g's IQ4_XS superblocks (pitch bytes apart from src) in the X8 layout at dst (see X8): the 6-bit scales
// unpacked to a signed byte (scale - 32), the nibbles rearranged as X8 | Q4_0's.
void interleave_iq4_xs(const uint8_t* src, int64_t pitch, int64_t nsb, int64_t g, uint8_t* dst) {
  for (int64_t s = 0; s < nsb; ++s) {
    uint8_t* o = dst + (g * nsb + s) * x8_bytes(IQ4_XS);
    for (int64_t r = 0; r < 8; ++r) {
      const uint8_t* sb = src + (8 * g + r) * pitch + s * block_bytes(IQ4_XS);
      // d and the scales' bytes copied to a local first: read straight from sb, GCC 12.2 at -O3 (its induction
      // variable optimization) compiles this loop into one that writes nothing.
      uint8_t head[8];
      std::memcpy(head, sb, 8);
      const int high = head[2] | (head[3] << 8);
      o[2 * r] = head[0];
      o[2 * r + 1] = head[1];
      for (int j = 0; j < 8; ++j) {
        const int scale = ((head[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4);
        o[16 + 8 * j + r] = uint8_t(scale - 32);
      }
      for (int j = 0; j < 8; ++j)
        for (int k = 0; k < 4; ++k) std::memcpy(o + 80 + 128 * j + 32 * k + 4 * r, sb + 8 + 16 * j + 4 * k, 4);
    }
  }
}

// Group g's Q3_K superblocks (pitch bytes apart from src) in the X8 layout at dst (see X8): d as it is, the 6-bit
// scales unpacked to a signed byte (scale - 32), the codes' low bits and high bits regrouped for the kernels' loads.
void interleave_q3_k(const uint8_t* src, int64_t pitch, int64_t nsb, int64_t g, uint8_t* dst, KRow& kr) {
  for (int64_t s = 0; s < nsb; ++s) {
    uint8_t* o = dst + (g * nsb + s) * x8_bytes(Q3_K);
    for (int64_t r = 0; r < 8; ++r) {
      const uint8_t* sb = src + (8 * g + r) * pitch + s * block_bytes(Q3_K);
      unpack_q3_k(sb, kr, 0);  // codes 0..7 (the high bit at bit 2), sc16 = scale - 32
      std::memcpy(o + 2 * r, sb + 108, 2);
      for (int h = 0; h < 16; ++h) o[16 + 8 * h + r] = uint8_t(int8_t(kr.sc16[h]));
      for (int j = 0; j < 8; ++j) {
        const uint8_t* c = kr.codes + 32 * j;
        uint8_t* block = o + 144 + 96 * j;
        for (int i = 0; i < 4; ++i) {
          uint8_t first = 0, second = 0, high = 0;
          for (int k = 0; k < 4; ++k) {
            const uint8_t lo = c[4 * k + i], hi = c[16 + 4 * k + i];
            first |= (lo & 3) << (2 * k);
            second |= (hi & 3) << (2 * k);
            high |= ((lo >> 2) << k) | ((hi >> 2) << (4 + k));
          }
          block[4 * r + i] = first;
          block[32 + 4 * r + i] = second;
          block[64 + 4 * r + i] = high;
        }
      }
    }
  }
}

}  // namespace

// Blocks [rows, row bytes] (rows a multiple of 8; rows may be strided) in the X8 layout [rows / 8, 8 row bytes
// as X8 holds them]: Q4_0/Q4_1/Q8_0/IQ4_NL/MXFP4 (held) the same bytes rearranged, Q5_0/Q5_1 too with their fifth bits regrouped,
// IQ4_XS with its scales unpacked, the
// k-quants with their scales unpacked (see X8); into `out` when given (contiguous, that shape).
at::Tensor interleave(const at::Tensor& blocks, int64_t qtype, const c10::optional<at::Tensor>& out_in) {
  TORCH_CHECK(interleaved_type(qtype), "rungen_ggml: only Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, "
              "IQ4_NL, IQ4_XS and MXFP4 rows are interleaved");
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 2 && blocks.stride(1) == 1 && blocks.size(0) % 8 == 0,
              "rungen_ggml: interleave takes uint8 [rows, bytes] with rows a multiple of 8");
  const bool five = qtype == Q5_0 || qtype == Q5_1;
  const int64_t bytes = block_bytes(qtype), head = qtype == Q4_1 || qtype == Q5_1 ? 4 : 2, nb = blocks.size(1) / bytes;
  const int64_t groups_of_4 = qtype == Q8_0 ? 8 : 4;  // four-byte pieces of a row's codes
  TORCH_CHECK(blocks.size(1) == nb * bytes, "rungen_ggml: rows are not whole blocks");
  const int64_t out_bytes = nb * x8_bytes(qtype);
  at::Tensor out = out_in.has_value() ? *out_in : at::empty({blocks.size(0) / 8, out_bytes}, blocks.options());
  TORCH_CHECK(out.dtype() == at::kByte && out.dim() == 2 && out.size(0) == blocks.size(0) / 8 &&
              out.size(1) == out_bytes && out.is_contiguous(),
              "rungen_ggml: interleave's out must be contiguous uint8 [rows / 8, ", out_bytes, "]");
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t pitch = blocks.stride(0);
  if (qtype == IQ4_XS) {
    at::parallel_for(0, out.size(0), 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) interleave_iq4_xs(src, pitch, nb, g, dst);
    });
    return out;
  }
  if (qtype == Q3_K) {
    at::parallel_for(0, out.size(0), 1, [&](int64_t g0, int64_t g1) {
      KRow kr(256);
      for (int64_t g = g0; g < g1; ++g) interleave_q3_k(src, pitch, nb, g, dst, kr);
    });
    return out;
  }
  if (x8_kquant(qtype)) {
    at::parallel_for(0, out.size(0), 1, [&](int64_t g0, int64_t g1) {
      KRow kr(256);
      for (int64_t g = g0; g < g1; ++g) interleave_kquant(src, pitch, qtype, nb, g, dst, kr);
    });
    return out;
  }
  at::parallel_for(0, out.size(0), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* o = dst + (g * nb + b) * 8 * bytes;
        for (int64_t lane = 0; lane < 8; ++lane) {
          const uint8_t* p = src + (8 * g + lane) * pitch + b * bytes;
          std::memcpy(o + 2 * lane, p, 2);                                        // d
          if (head == 4) std::memcpy(o + 16 + 2 * lane, p + 2, 2);                // m
          if (five) {  // the fifth bits' plane, then the nibbles
            uint32_t qh;
            std::memcpy(&qh, p + head, 4);
            for (int i = 0; i < 4; ++i) {
              uint8_t bits = 0;
              for (int j = 0; j < 4; ++j)
                bits |= uint8_t(((qh >> (4 * j + i)) & 1) << j | ((qh >> (16 + 4 * j + i)) & 1) << (4 + j));
              o[8 * head + 4 * lane + i] = bits;
            }
            for (int j = 0; j < 4; ++j) std::memcpy(o + 8 * head + 32 + 32 * j + 4 * lane, p + head + 4 + 4 * j, 4);
            continue;
          }
          for (int j = 0; j < groups_of_4; ++j) std::memcpy(o + 8 * head + 32 * j + 4 * lane, p + head + 4 * j, 4);
        }
      }
  });
  return out;
}

// MXFP4 blocks [rows, row bytes] (gpt-oss's experts: per 32 weights a scale byte e, 2^(e - 128), then 16 bytes
// of e2m1 codes) as the kernels hold them: IQ4_NL's blocks (see X8), the scale in float16 (exact from 2^-24 to 2^15,
// float16's nearest below), the codes as they are. A scale above float16's range is refused unless the block's
// codes are all zeros (+0 and -0).
at::Tensor mxfp4_held(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 2 && blocks.stride(1) == 1 && blocks.size(1) % 17 == 0,
              "rungen_ggml: mxfp4_held takes uint8 [rows, whole 17-byte blocks]");
  const int64_t rows = blocks.size(0), nb = blocks.size(1) / 17, pitch = blocks.stride(0);
  at::Tensor out = at::empty({rows, nb * 18}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  // Each scale byte's float16 (0 where it is beyond float16's range: checked below), looked up.
  uint16_t half[256];
  bool finite[256];
  for (int e = 0; e < 256; ++e) {
    const c10::Half d(std::ldexp(1.0f, e - 128));
    finite[e] = !std::isinf(float(d));
    half[e] = finite[e] ? d.x : 0;
  }
  std::atomic<int> beyond{-1};
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = src + r * pitch + 17 * b;
        uint8_t* o = dst + (r * nb + b) * 18;
        if (!finite[p[0]]) {
          bool zero = true;
          for (int j = 0; j < 16; ++j) zero = zero && (p[1 + j] & 0x77) == 0;
          if (!zero) beyond = p[0];
        }
        std::memcpy(o, &half[p[0]], 2);
        std::memcpy(o + 2, p + 1, 16);
      }
  });
  TORCH_CHECK(beyond < 0, "rungen_ggml: an MXFP4 block's scale 2^", beyond - 128, " is beyond float16's range");
  return out;
}

}  // namespace rungen_ggml
