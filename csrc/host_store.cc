// XLA FFI handlers of layer_scan's host store (Python side: _src/offload/host_store.py).
//
// XLA schedules a while loop's host copies right next to the ops that need them, so in a
// scanned layer stack every copy is exposed (docs/notes/2026-12-03-layer-scan.md). These
// handlers issue the copies themselves, on two streams of their own per device, ordered
// against XLA's stream with CUDA events:
//
//   put_start(arrays...; store) -> serial   XLA's stream: record; the copy-out stream
//                                            waits, then copies the arrays into one pinned
//                                            host entry pushed on stack `store`.
//                                            serial: the entry's number, in every element
//                                            of an int32 array (a scalar, or [B] under vmap).
//   put_done(arrays..., more...)            XLA's stream waits for the copies out (the
//                                            arrays are operands, so they stay alive).
//   get_start(serial; store) -> arrays...   pops stack `store` (an error when it is empty
//                                            or the entry's bytes differ) and copies it
//                                            back on the copy-in stream. When `serial` is
//                                            not the entry's (the forward and backward
//                                            passes ran out of order), the entry's bytes
//                                            are set to 0xFF first (NaN in every float
//                                            format) and the store's later get_done calls
//                                            fail.
//   get_done(arrays..., more...) -> arrays  XLA's stream waits for the copies in; the
//                                            results alias the first operands.
//
// `more...` are operands only there to order the call after them (XLA cannot move it
// before they exist). Host entries are pinned (cudaHostAlloc), reused by size, and kept
// until HostStoreRelease frees the idle ones (those on no stack). Nothing here may be
// captured into a CUDA graph (the handlers keep host state), so none is marked
// command-buffer compatible.
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels.h"

namespace jgm {
namespace {

constexpr size_t kAlign = 256;
size_t Aligned(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Entry {
  size_t bytes = 0;
  char* host = nullptr;
  int32_t serial = 0;
  int32_t* seen = nullptr;  // pinned: the serial the backward pass handed back
  cudaEvent_t written = nullptr, read = nullptr;
  bool was_read = false;
};

struct Device {
  std::mutex mu;
  cudaStream_t out = nullptr, in = nullptr;  // device -> host, host -> device
  cudaEvent_t xla = nullptr, out_done = nullptr, in_done = nullptr;
  std::map<int64_t, std::vector<Entry*>> stacks;
  std::map<int64_t, std::shared_ptr<std::atomic<bool>>> out_of_order;  // set by CheckSerial
  std::multimap<size_t, Entry*> free;
  int32_t next_serial = 0;
};

ffi::Error Fail(const char* handler, const std::string& what) {
  return ffi::Error::Internal(std::string("jgm_host_") + handler + ": " + what);
}

ffi::Error Cuda(const char* handler, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return Fail(handler, cudaGetErrorString(err));
}

std::mutex g_devices_mu;
std::map<int32_t, std::unique_ptr<Device>> g_devices;

// The device's streams and events, created at first use (with that device current).
Device* GetDevice(int32_t ordinal, cudaError_t* err) {
  std::lock_guard<std::mutex> lock(g_devices_mu);
  auto& devices = g_devices;
  auto& slot = devices[ordinal];
  if (slot) return slot.get();
  auto d = std::make_unique<Device>();
  int previous = 0;
  *err = cudaGetDevice(&previous);
  if (!*err) *err = cudaSetDevice(ordinal);
  if (!*err) *err = cudaStreamCreateWithFlags(&d->out, cudaStreamNonBlocking);
  if (!*err) *err = cudaStreamCreateWithFlags(&d->in, cudaStreamNonBlocking);
  for (cudaEvent_t* e : {&d->xla, &d->out_done, &d->in_done})
    if (!*err) *err = cudaEventCreateWithFlags(e, cudaEventDisableTiming);
  cudaSetDevice(previous);
  if (*err) return nullptr;
  slot = std::move(d);
  return slot.get();
}

// An entry of exactly `bytes` from the free list, or a new one.
cudaError_t TakeEntry(Device* d, size_t bytes, Entry** entry) {
  auto it = d->free.find(bytes);
  if (it != d->free.end()) {
    *entry = it->second;
    d->free.erase(it);
    return cudaSuccess;
  }
  auto e = std::make_unique<Entry>();
  e->bytes = bytes;
  // Portable: pinned for every device's context (one process may drive several GPUs).
  cudaError_t err = cudaHostAlloc(reinterpret_cast<void**>(&e->host), bytes ? bytes : 1, cudaHostAllocPortable);
  if (!err) err = cudaHostAlloc(reinterpret_cast<void**>(&e->seen), sizeof(int32_t), cudaHostAllocPortable);
  if (!err) err = cudaEventCreateWithFlags(&e->written, cudaEventDisableTiming);
  if (!err) err = cudaEventCreateWithFlags(&e->read, cudaEventDisableTiming);
  if (!err) *entry = e.release();  // owned by the device's lists from here on
  return err;
}

// `to` waits for all work enqueued on `from` so far.
cudaError_t Follow(cudaStream_t to, cudaStream_t from, cudaEvent_t event) {
  cudaError_t err = cudaEventRecord(event, from);
  return err ? err : cudaStreamWaitEvent(to, event, 0);
}

size_t TotalBytes(const std::vector<std::pair<void*, size_t>>& parts) {
  size_t total = 0;
  for (const auto& p : parts) total += Aligned(p.second);
  return total;
}

ffi::Error PutStart(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs arrays,
                    ffi::Result<ffi::AnyBuffer> serial, int64_t store) {
  if (serial->element_type() != ffi::S32) return Fail("put_start", "serial must be int32");
  std::vector<std::pair<void*, size_t>> parts;
  for (size_t i = 0; i < arrays.size(); ++i) {
    auto a = arrays.get<ffi::AnyBuffer>(i);
    if (!a.has_value()) return Fail("put_start", "operand " + std::to_string(i) + " is not an array");
    parts.emplace_back(a->untyped_data(), a->size_bytes());
  }
  cudaError_t err = cudaSuccess;
  Device* d = GetDevice(ordinal, &err);
  if (!d) return Cuda("put_start", err);
  std::lock_guard<std::mutex> lock(d->mu);
  Entry* e = nullptr;
  if ((err = TakeEntry(d, TotalBytes(parts), &e))) return Cuda("put_start", err);
  err = Follow(d->out, stream, d->xla);  // the arrays are written
  if (!err && e->was_read) err = cudaStreamWaitEvent(d->out, e->read, 0);  // the entry's last reader is done
  size_t offset = 0;
  for (const auto& p : parts) {
    if (!err && p.second) err = cudaMemcpyAsync(e->host + offset, p.first, p.second, cudaMemcpyDeviceToHost, d->out);
    offset += Aligned(p.second);
  }
  if (!err) err = cudaEventRecord(e->written, d->out);
  if (err) return Cuda("put_start", err);  // (the entry is dropped: copies may be queued into it)
  d->next_serial = d->next_serial == INT32_MAX ? 1 : d->next_serial + 1;
  e->serial = d->next_serial;
  d->stacks[store].push_back(e);
  // From pageable memory: staged at once, so the vector may go out of scope.
  const std::vector<int32_t> values(serial->element_count(), e->serial);
  return Cuda("put_start", values.empty() ? cudaSuccess
                                          : cudaMemcpyAsync(serial->untyped_data(), values.data(), serial->size_bytes(),
                                                            cudaMemcpyHostToDevice, stream));
}

ffi::Error PutDone(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs) {
  cudaError_t err = cudaSuccess;
  Device* d = GetDevice(ordinal, &err);
  if (!d) return Cuda("put_done", err);
  std::lock_guard<std::mutex> lock(d->mu);
  return Cuda("put_done", Follow(stream, d->out, d->out_done));
}

struct Check {
  Entry* entry;
  int32_t expected;
  std::shared_ptr<std::atomic<bool>> out_of_order;
};

std::shared_ptr<std::atomic<bool>>& OutOfOrder(Device* d, int64_t store) {
  auto& flag = d->out_of_order[store];
  if (!flag) flag = std::make_shared<std::atomic<bool>>(false);
  return flag;
}

// Runs on the copy-in stream once the handed-back serial is in entry->seen, before the
// entry's bytes are copied in: a mismatch poisons them.
void CUDART_CB CheckSerial(void* arg) {
  std::unique_ptr<Check> c(static_cast<Check*>(arg));
  if (*c->entry->seen != c->expected) {
    std::memset(c->entry->host, 0xFF, c->entry->bytes);
    c->out_of_order->store(true);
  }
}

ffi::Error GetStart(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer serial, ffi::RemainingRets arrays,
                    int64_t store) {
  if (serial.element_type() != ffi::S32 || serial.element_count() == 0)
    return Fail("get_start", "serial must be a non-empty int32 array");
  std::vector<std::pair<void*, size_t>> parts;
  for (size_t i = 0; i < arrays.size(); ++i) {
    auto a = arrays.get<ffi::AnyBuffer>(i);
    if (!a.has_value()) return Fail("get_start", "result " + std::to_string(i) + " is not an array");
    parts.emplace_back((*a)->untyped_data(), (*a)->size_bytes());
  }
  cudaError_t err = cudaSuccess;
  Device* d = GetDevice(ordinal, &err);
  if (!d) return Cuda("get_start", err);
  std::lock_guard<std::mutex> lock(d->mu);
  auto& stack = d->stacks[store];
  if (stack.empty())
    return Fail("get_start", "store " + std::to_string(store) + " is empty: a layer_scan backward pass ran without "
                "its forward pass (each forward's host copies are read back once)");
  Entry* e = stack.back();
  if (e->bytes != TotalBytes(parts))
    return Fail("get_start", "store " + std::to_string(store) + " holds " + std::to_string(e->bytes) +
                " bytes, the results take " + std::to_string(TotalBytes(parts)));
  stack.pop_back();
  err = Follow(d->in, stream, d->xla);  // the results' memory is free, `serial` is written
  if (!err) err = cudaStreamWaitEvent(d->in, e->written, 0);
  if (!err) err = cudaMemcpyAsync(e->seen, serial.untyped_data(), sizeof(int32_t), cudaMemcpyDeviceToHost, d->in);
  auto check = std::make_unique<Check>(Check{e, e->serial, OutOfOrder(d, store)});
  if (!err) err = cudaLaunchHostFunc(d->in, CheckSerial, check.get());
  if (!err) check.release();
  size_t offset = 0;
  for (const auto& p : parts) {
    if (!err && p.second) err = cudaMemcpyAsync(p.first, e->host + offset, p.second, cudaMemcpyHostToDevice, d->in);
    offset += Aligned(p.second);
  }
  if (!err) err = cudaEventRecord(e->read, d->in);
  if (err) return Cuda("get_start", err);  // (dropped: its check or copies may still run)
  e->was_read = true;
  d->free.emplace(e->bytes, e);
  return ffi::Error::Success();
}

ffi::Error GetDone(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs args, ffi::RemainingRets arrays,
                   int64_t store) {
  cudaError_t err = cudaSuccess;
  Device* d = GetDevice(ordinal, &err);
  if (!d) return Cuda("get_done", err);
  {
    std::lock_guard<std::mutex> lock(d->mu);
    if ((err = Follow(stream, d->in, d->in_done))) return Cuda("get_done", err);
    if (OutOfOrder(d, store)->load())  // (seen once the check of an earlier get_start has run)
      return Fail("get_done", "store " + std::to_string(store) + ": a layer_scan backward pass read host copies "
                  "that another forward pass wrote (run each forward's backward before the next forward, or in "
                  "reverse order); the arrays read back were NaN");
  }
  for (size_t i = 0; i < arrays.size(); ++i) {  // the results alias the operands; copy if XLA did not
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = arrays.get<ffi::AnyBuffer>(i);
    if (!in.has_value() || !out.has_value()) return Fail("get_done", "operand/result " + std::to_string(i));
    if (in->untyped_data() != (*out)->untyped_data() && in->size_bytes())
      if ((err = cudaMemcpyAsync((*out)->untyped_data(), in->untyped_data(), in->size_bytes(),
                                 cudaMemcpyDeviceToDevice, stream)))
        return Cuda("get_done", err);
  }
  return ffi::Error::Success();
}

}  // namespace

HostStoreMemory HostStoreStats() {
  HostStoreMemory m;
  std::lock_guard<std::mutex> lock(g_devices_mu);
  for (auto& [ordinal, d] : g_devices) {
    std::lock_guard<std::mutex> device_lock(d->mu);
    for (const auto& [store, stack] : d->stacks)
      for (const Entry* e : stack) m.in_use_bytes += e->bytes, ++m.in_use_entries;
    for (const auto& [bytes, e] : d->free) m.idle_bytes += e->bytes, ++m.idle_entries;
  }
  return m;
}

cudaError_t HostStoreRelease(int64_t* released) {
  *released = 0;
  std::vector<Entry*> idle;  // taken off the free lists under the locks, freed after them
  {
    std::lock_guard<std::mutex> lock(g_devices_mu);
    for (auto& [ordinal, d] : g_devices) {
      std::lock_guard<std::mutex> device_lock(d->mu);
      for (auto& [bytes, e] : d->free) idle.push_back(e);
      d->free.clear();
    }
  }
  cudaError_t first = cudaSuccess;
  for (Entry* e : idle) {
    // Its last copies out and back (the latter after its serial check) must be done.
    cudaError_t err = cudaEventSynchronize(e->written);
    if (!err) err = cudaEventSynchronize(e->read);
    if (!err) err = cudaFreeHost(e->host);
    if (!err) err = cudaFreeHost(e->seen);
    if (!err) err = cudaEventDestroy(e->written);
    if (!err) err = cudaEventDestroy(e->read);
    if (err && !first) first = err;
    *released += err ? 0 : static_cast<int64_t>(e->bytes);
    delete e;  // (a failed free leaks its pinned memory rather than reusing it)
  }
  return first;
}

}  // namespace jgm

namespace ffi = xla::ffi;
XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmHostPutStart, jgm::PutStart,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()       // the arrays to copy out
                                  .Ret<ffi::AnyBuffer>()  // serial: int32, any shape
                                  .Attr<int64_t>("store"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmHostPutDone, jgm::PutDone,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs());  // the arrays copied out, then ordering operands
XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmHostGetStart, jgm::GetStart,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // serial put_start returned (its first element)
                                  .RemainingRets()                 // the arrays, as put_start took them
                                  .Attr<int64_t>("store"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JgmHostGetDone, jgm::GetDone,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()  // get_start's arrays, then its serial and ordering operands
                                  .RemainingRets()  // the arrays (aliased)
                                  .Attr<int64_t>("store"));
