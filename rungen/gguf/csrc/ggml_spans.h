// Which kernel takes an interleaved weight's groups, by type and number of tokens: ggml_avx2.cpp and ggml_vnni.cpp
// include this file last, inside the same namespace and target as the kernels.

// One group against every token: the kernels that read their blocks unpacked (Q3_K; on AVX2 the other k-quants
// and IQ4) through unpacked_tokens, the others four, two, then one token a pass.
template <int64_t BASE>
static void x8_tokens(const uint8_t* group, int64_t nb, const Act& a, int64_t k, float* y, int64_t stride) {
  if constexpr (BASE == Q3_K) {
    unpacked_tokens(Q3kX8{group}, nb, a, k, y, stride);
#ifndef GGML_VNNI
  } else if constexpr (BASE == Q4_K || BASE == Q5_K || BASE == Q6_K) {
    unpacked_tokens(Kx8<BASE>{group}, nb, a, k, y, stride);
  } else if constexpr (iq4_type(BASE)) {
    unpacked_tokens(Iq4X8<BASE>{group}, nb, a, k, y, stride);
#endif
  } else {
    int64_t t = x8_pass<BASE, 4>(group, nb, a, k, y, stride, 0, a.n);
    t = x8_pass<BASE, 2>(group, nb, a, k, y, stride, t, a.n);
    x8_pass<BASE, 1>(group, nb, a, k, y, stride, t, a.n);
  }
}


// Groups [g0, g1) of one type against every token: four tokens a pass while a group's blocks (a few KB) stay in
// the L1 cache, then two, then one (eight no longer fit the sixteen registers). On VNNI from eight tokens on, two
// groups at a time (X16; an odd one left over takes the X8 kernel); decode and small batches keep the X8 kernels,
// which a model's decode, streaming its weights from memory, runs faster (docs/kernels.md, "Measured choices").
template <int64_t BASE>
static void x8_span(const Job& job, int64_t g0, int64_t g1) {
  const Act& a = *job.act;
  const int64_t nb = job.in_features / 32;
  int64_t g = g0;
#ifdef GGML_VNNI
  // With the tiles (every type but Q6_K), sixteen tokens at a time through them, the rest (fewer than sixteen) as
  // without.
  const int64_t tiled = current_isa == AMX && amx_takes(BASE) && a.n >= 16 && g + 2 <= g1 ? a.n / 16 * 16 : 0;
  if (tiled) amx_configure();
  if (a.n >= 8)
    for (; g + 2 <= g1; g += 2) {
      const uint8_t* group = job.blocks + g * job.pitch;
      float* y = job.y + 8 * g;
      if constexpr (amx_takes(BASE))
        if (tiled) amx_pair<BASE>(group, job.pitch, nb, a, job.in_features, y, job.out_features, tiled);
      if (tiled == a.n) continue;
      x16_tokens<BASE>(group, job.pitch, nb, a, job.in_features, y, job.out_features, tiled);
    }
  if (tiled) amx_release();
#endif
  for (; g < g1; ++g)
    x8_tokens<BASE>(job.blocks + g * job.pitch, nb, a, job.in_features, job.y + 8 * g, job.out_features);
}

// Groups [g0, g1) of an X8 weight against every token.
void x8_rows(const Job& job, int64_t g0, int64_t g1) {
  switch (job.qtype & ~X8) {
    case Q4_0: return x8_span<Q4_0>(job, g0, g1);
    case Q4_1: return x8_span<Q4_1>(job, g0, g1);
    case Q5_0: return x8_span<Q5_0>(job, g0, g1);
    case Q5_1: return x8_span<Q5_1>(job, g0, g1);
    case Q4_K: return x8_span<Q4_K>(job, g0, g1);
    case Q5_K: return x8_span<Q5_K>(job, g0, g1);
    case Q6_K: return x8_span<Q6_K>(job, g0, g1);
    case IQ4_NL: return x8_span<IQ4_NL>(job, g0, g1);
    case MXFP4: return x8_span<MXFP4>(job, g0, g1);
    case IQ4_XS: return x8_span<IQ4_XS>(job, g0, g1);
    case Q3_K: return x8_span<Q3_K>(job, g0, g1);
    default: return x8_span<Q8_0>(job, g0, g1);
  }
}
