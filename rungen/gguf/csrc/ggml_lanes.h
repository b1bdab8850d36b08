// What the recurrent steps' loops (ggml_delta.h, ggml_mamba.h) share, included by them inside each build's namespace
// (so no include guard): Lanes, sixteen floats as one value (GCC's vector extension: the build's widest registers,
// two AVX2 ones, four SSE ones), its arithmetic lane by lane, the same bits in every build; and a prompt's
// convolution of a position.
typedef float Lanes __attribute__((vector_size(64)));
typedef int32_t LaneIndex __attribute__((vector_size(64)));

static inline Lanes lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

static inline void store(float* p, const Lanes& v) { std::memcpy(p, &v, sizeof v); }

// The sum of v's lanes in one fixed order (halves added, then their halves, ...): the same in every build.
static inline float total(Lanes v) {
  v += __builtin_shuffle(v, LaneIndex{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, LaneIndex{4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, LaneIndex{2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
  v += __builtin_shuffle(v, LaneIndex{1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
  return v[0];
}

// sums[c] (zeroed first) = a prompt position's convolution: the inputs of its last `kernel` positions (those before
// the first zeros), oldest first as a decode step's window sums them, by the weights of each tap (taps [kernel,
// channels]); `x` a sequence's inputs [inputs, channels], `last` the position's row among them.
static inline void convolve_position(const float* x, int64_t last, int64_t kernel, const float* taps,
                                     int64_t channels, float* sums) {
  std::fill(sums, sums + channels, 0.f);
  for (int64_t j = 0; j < kernel; ++j) {
    const int64_t at = last - (kernel - 1) + j;
    if (at < 0) continue;
    const float* __restrict__ input = x + at * channels;
    const float* __restrict__ tap = taps + j * channels;
    for (int64_t c = 0; c < channels; ++c) sums[c] += input[c] * tap[c];
  }
}
