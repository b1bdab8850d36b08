// tests/virtual_cuda.py's device guard for CUDA on a CPU build of torch: C++ that guards a cuda tensor's device
// (indexing, Tensor.to) finds one device, and the operators themselves go to the played GPU.
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
struct PlayedGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device) const override { return {c10::DeviceType::CUDA, 0}; }
  c10::Device getDevice() const override { return {c10::DeviceType::CUDA, 0}; }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device device) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, device); }
  c10::Stream exchangeStream(c10::Stream stream) const noexcept override { return stream; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
};
C10_REGISTER_GUARD_IMPL(CUDA, PlayedGuard);
}  // namespace
