// Sixteen floats as one value (GCC's vector extension: the build's widest registers, two AVX2 ones, four SSE ones),
// its arithmetic lane by lane: the same bits in every build. Included by the recurrent steps' loops (ggml_delta.h,
// ggml_mamba.h) inside each build's namespace, so no include guard.
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
