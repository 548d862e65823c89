//! [`CudaDevice`] (feature `cuda`): the [`Device`] interface on one NVIDIA GPU,
//! through `cust` and zeropp-quant's CUDA kernels (the `*_at` calls of
//! [`Gpu`], on addresses inside this module's allocations).
//!
//! Each stream is a [`Gpu`] of its own (own CUDA stream, same primary context),
//! so each rank of a [`DeviceCluster`](super::DeviceCluster) enqueues on its own
//! stream; events are raw CUDA events (cust's are neither clonable nor waitable
//! by reference), created without timing. Device-to-device copies and memsets are
//! asynchronous; quantizing calls synchronize their stream (the non-finite check
//! reads a flag back); uploads and downloads synchronize the stream first.
//!
//! This is the only part of the device collectives that needs a GPU to run; CI
//! compiles it (stub driver) and `tests/it/device_gpu.rs` runs it where a GPU is.

use std::sync::Arc;

use zeropp_quant::cuda::cust::memory::{CopyDestination, DeviceBuffer, DevicePointer, DeviceSlice};
use zeropp_quant::cuda::cust::sys;
use zeropp_quant::cuda::{Elementwise, Gpu, WireAt};
use zeropp_quant::half::bf16;
use zeropp_quant::{QuantError, encoded_len};

use super::{Device, Elem, Kernel, View};
use crate::CommError;

/// One NVIDIA GPU (device 0) as a [`Device`].
#[derive(Debug, Clone)]
pub struct CudaDevice {
    /// Keeps the primary context retained for the device's lifetime.
    gpu: Arc<Gpu>,
}

impl CudaDevice {
    /// Device 0, or the CUDA error (no driver, no device) wrapped in
    /// [`CommError::Quant`].
    pub fn new() -> Result<Self, CommError> {
        Ok(Self { gpu: Arc::new(Gpu::new()?) })
    }

    /// The kernels' GPU handle (device name, driver version, loaded image).
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

/// A [`CudaDevice`] allocation.
#[derive(Debug)]
pub struct CudaMem(DeviceBuffer<u8>);

impl CudaMem {
    /// The allocation's device address.
    pub fn device_addr(&self) -> u64 {
        self.0.as_device_ptr().as_raw()
    }
}

/// A [`CudaDevice`] stream: a [`Gpu`] with its own CUDA stream.
#[derive(Debug)]
pub struct CudaStream(Gpu);

impl CudaStream {
    /// The stream's kernel handle.
    pub fn gpu(&self) -> &Gpu {
        &self.0
    }
}

/// A CUDA event (recorded once).
#[derive(Debug)]
pub struct CudaEvent(sys::CUevent);

// SAFETY: a CUevent is a driver handle; the driver API may be called on it from
// any thread of the process (CUDA's thread-safety guarantee for handles).
unsafe impl Send for CudaEvent {}
// SAFETY: as above; recording and waiting take the handle by value, and this
// type only records at creation and destroys on drop.
unsafe impl Sync for CudaEvent {}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: the handle came from cuEventCreate and is destroyed once; the
        // driver defers the release until the recorded work completes.
        let _ = unsafe { sys::cuEventDestroy_v2(self.0) };
    }
}

/// A driver status as a [`CommError::Device`] (`CUDA_SUCCESS` is 0).
fn check(status: sys::CUresult, what: &str) -> Result<(), CommError> {
    if status == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CommError::Device { api: "cuda", code: status as i32, what: format!("{what}: {status:?}") })
    }
}

fn addr(v: View<'_, CudaDevice>) -> u64 {
    v.mem().0.as_device_ptr().as_raw() + v.offset() as u64
}

/// Before a synchronous copy of `host` bytes to or from a device window of
/// `window` bytes: the lengths agree (else a [`CommError::Mismatch`] saying
/// `why()`), and unless empty (`false`: nothing to copy) the stream's context
/// is current and its earlier work done.
fn host_copy(
    s: &CudaStream,
    host: usize,
    window: usize,
    why: impl FnOnce() -> String,
) -> Result<bool, CommError> {
    if host != window {
        return Err(CommError::Mismatch(why()));
    }
    if host == 0 {
        return Ok(false);
    }
    s.0.make_current()?;
    s.0.stream().synchronize().map_err(QuantError::from)?;
    Ok(true)
}

fn stream_of(s: &CudaStream) -> sys::CUstream {
    s.0.stream().as_inner()
}

impl CudaDevice {
    /// Quantizing into `dst`: in place when the data region is word-aligned or
    /// the INT4 packing needs no atomics, else through an aligned scratch buffer.
    fn quantize_into(
        &self,
        s: &CudaStream,
        dst: View<'_, Self>,
        spec: zeropp_quant::QuantSpec,
        len: usize,
        run: impl FnOnce(WireAt) -> Result<(), QuantError>,
    ) -> Result<(), CommError> {
        if dst.len() != encoded_len(spec, len) {
            return Err(CommError::Mismatch(format!(
                "quantize: window of {} bytes for an encoding of {}",
                dst.len(),
                encoded_len(spec, len)
            )));
        }
        // The kernels write scales (and offsets) as f32, and INT4 with an odd
        // group size ORs data words: the encoding must start 4-byte aligned.
        if addr(dst).is_multiple_of(4) {
            return Ok(run(WireAt { addr: addr(dst), spec, len })?);
        }
        let scratch = DeviceBuffer::<u8>::zeroed(dst.len()).map_err(QuantError::from)?;
        run(WireAt { addr: scratch.as_device_ptr().as_raw(), spec, len })?;
        let from = scratch.as_device_ptr().as_raw();
        // SAFETY: both ranges are live device memory of `dst.len()` bytes; the
        // copy is ordered on this stream before the scratch buffer's synchronous free.
        let status = unsafe { sys::cuMemcpyDtoDAsync_v2(addr(dst), from, dst.len(), stream_of(s)) };
        check(status, "copy")?;
        s.0.stream().synchronize().map_err(QuantError::from)?;
        Ok(())
    }
}

/// Encodings the kernels read: in place when 4-byte aligned (f32 scales), else
/// copied into an aligned scratch buffer first (wire encodings sit back to back
/// in the collectives' buffers, at offsets that need not be multiples of 4).
struct Aligned {
    scratch: Vec<DeviceBuffer<u8>>,
}

impl Aligned {
    fn new() -> Self {
        Self { scratch: Vec::new() }
    }

    fn at(
        &mut self,
        s: &CudaStream,
        v: View<'_, CudaDevice>,
        spec: zeropp_quant::QuantSpec,
        len: usize,
    ) -> Result<WireAt, CommError> {
        if addr(v).is_multiple_of(4) {
            return Ok(WireAt { addr: addr(v), spec, len });
        }
        let b = DeviceBuffer::<u8>::zeroed(v.len()).map_err(QuantError::from)?;
        let to = b.as_device_ptr().as_raw();
        // SAFETY: both ranges are live device memory of `v.len()` bytes; ordered on the stream.
        let status = unsafe { sys::cuMemcpyDtoDAsync_v2(to, addr(v), v.len(), stream_of(s)) };
        check(status, "copy")?;
        self.scratch.push(b);
        Ok(WireAt { addr: to, spec, len })
    }

    /// Waits for the stream before the scratch buffers are freed.
    fn finish(self, s: &CudaStream) -> Result<(), CommError> {
        if !self.scratch.is_empty() {
            s.0.stream().synchronize().map_err(QuantError::from)?;
        }
        Ok(())
    }
}

impl Device for CudaDevice {
    type Mem = CudaMem;
    type Stream = CudaStream;
    type Event = CudaEvent;

    fn name(&self) -> String {
        self.gpu.device_name().unwrap_or_else(|_| "CUDA device".into())
    }

    fn alloc(&self, bytes: usize) -> Result<CudaMem, CommError> {
        self.gpu.make_current()?;
        Ok(CudaMem(DeviceBuffer::zeroed(bytes).map_err(QuantError::from)?))
    }

    fn stream(&self) -> Result<CudaStream, CommError> {
        Ok(CudaStream(Gpu::new()?))
    }

    fn upload(&self, s: &CudaStream, src: &[u8], dst: View<'_, Self>) -> Result<(), CommError> {
        let why = || format!("upload: {} bytes into a window of {}", src.len(), dst.len());
        if !host_copy(s, src.len(), dst.len(), why)? {
            return Ok(());
        }
        // SAFETY: `dst` is a live window of `src.len()` bytes; the slice does not own it.
        let mut d =
            unsafe { DeviceSlice::from_raw_parts_mut(DevicePointer::<u8>::from_raw(addr(dst)), dst.len()) };
        d.copy_from(src).map_err(QuantError::from)?;
        Ok(())
    }

    fn download(&self, s: &CudaStream, src: View<'_, Self>, dst: &mut [u8]) -> Result<(), CommError> {
        let why = || format!("download: window of {} bytes into {}", src.len(), dst.len());
        if !host_copy(s, dst.len(), src.len(), why)? {
            return Ok(());
        }
        // SAFETY: `src` is a live window of `dst.len()` bytes; the slice does not own it.
        let d = unsafe { DeviceSlice::from_raw_parts(DevicePointer::<u8>::from_raw(addr(src)), src.len()) };
        d.copy_to(dst).map_err(QuantError::from)?;
        Ok(())
    }

    fn copy(&self, s: &CudaStream, src: View<'_, Self>, dst: View<'_, Self>) -> Result<(), CommError> {
        if src.len() != dst.len() {
            return Err(CommError::Mismatch(format!("device copy: {} bytes into {}", src.len(), dst.len())));
        }
        if src.is_empty() {
            return Ok(());
        }
        s.0.make_current()?;
        // SAFETY: both windows are live device memory of `src.len()` bytes (views
        // are checked against their buffers); ordering is the stream's.
        check(unsafe { sys::cuMemcpyDtoDAsync_v2(addr(dst), addr(src), src.len(), stream_of(s)) }, "copy")
    }

    fn zero(&self, s: &CudaStream, dst: View<'_, Self>) -> Result<(), CommError> {
        if dst.is_empty() {
            return Ok(());
        }
        s.0.make_current()?;
        // SAFETY: `dst` is a live window of `dst.len()` bytes.
        check(unsafe { sys::cuMemsetD8Async(addr(dst), 0, dst.len(), stream_of(s)) }, "memset")
    }

    fn kernel(&self, s: &CudaStream, kernel: Kernel<'_, Self>) -> Result<(), CommError> {
        let gpu = &s.0;
        let need = |v: View<'_, Self>, bytes: usize, what: &str| -> Result<(), CommError> {
            if v.len() == bytes {
                Ok(())
            } else {
                Err(CommError::Mismatch(format!("{what}: window of {} bytes, expected {bytes}", v.len())))
            }
        };
        match kernel {
            Kernel::Quantize { src, elem, spec, opts, dst } => {
                let len = src.len() / elem.size();
                need(src, len * elem.size(), "quantize input")?;
                let from = addr(src);
                self.quantize_into(s, dst, spec, len, |out| {
                    // SAFETY: `from` addresses `len` live values of the element type
                    // and `out` a live encoding (checked lengths).
                    unsafe {
                        match elem {
                            Elem::F32 => gpu.quantize_at::<f32>(from, &opts, out),
                            Elem::Bf16 => gpu.quantize_at::<bf16>(from, &opts, out),
                        }
                    }
                })
            }
            Kernel::Dequantize { src, spec, len, dst, add } => {
                need(src, encoded_len(spec, len), "dequantize input")?;
                need(dst, 4 * len, "dequantize output")?;
                let mut aligned = Aligned::new();
                let q = aligned.at(s, src, spec, len)?;
                // SAFETY: `q` is a live encoding of `len` elements and `dst` holds
                // `len` f32 (checked).
                unsafe { gpu.dequantize_at(q, addr(dst), add)? };
                aligned.finish(s)
            }
            Kernel::DequantReduceQuant { inputs, len, spec, opts, dst } => {
                let mut aligned = Aligned::new();
                let mut ins = Vec::with_capacity(inputs.len());
                for &(v, sp) in inputs {
                    need(v, encoded_len(sp, len), "dequant_reduce_quant input")?;
                    ins.push(aligned.at(s, v, sp, len)?);
                }
                self.quantize_into(s, dst, spec, len, |out| {
                    // SAFETY: every input is a live encoding of `len` elements
                    // (checked) and `out` a live encoding (`quantize_into`).
                    unsafe { gpu.dequant_reduce_quant_at(&ins, &opts, out) }
                })?;
                aligned.finish(s)
            }
            Kernel::Add { src, elem, dst } => {
                let n = dst.len() / 4;
                need(src, n * elem.size(), "add")?;
                let (src, acc) = (addr(src), addr(dst));
                let op = match elem {
                    Elem::F32 => Elementwise::AddF32 { src, acc },
                    Elem::Bf16 => Elementwise::AddBf16 { src, acc },
                };
                // SAFETY: `n` live elements at both addresses (checked).
                unsafe { gpu.elementwise_at(op, n)? };
                Ok(())
            }
            Kernel::Div { buf, by } => {
                // SAFETY: `buf` holds `len / 4` live f32.
                unsafe { gpu.elementwise_at(Elementwise::DivF32 { x: addr(buf), by }, buf.len() / 4)? };
                Ok(())
            }
            Kernel::Feedback { comp, deq, res, beta } => {
                let n = res.len() / 4;
                need(comp, 4 * n, "feedback")?;
                need(deq, 4 * n, "feedback")?;
                let op = Elementwise::Feedback { comp: addr(comp), deq: addr(deq), res: addr(res), beta };
                // SAFETY: `n` live f32 at each address (checked).
                unsafe { gpu.elementwise_at(op, n)? };
                Ok(())
            }
            Kernel::ToBf16 { src, dst } => {
                let n = src.len() / 4;
                need(dst, 2 * n, "to_bf16")?;
                // SAFETY: `n` live f32 and `n` live bf16 (checked).
                unsafe { gpu.elementwise_at(Elementwise::ToBf16 { src: addr(src), out: addr(dst) }, n)? };
                Ok(())
            }
        }
    }

    fn record(&self, s: &CudaStream) -> Result<CudaEvent, CommError> {
        s.0.make_current()?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: `ev` is a valid out-pointer; flag 2 = CU_EVENT_DISABLE_TIMING.
        check(unsafe { sys::cuEventCreate(&mut ev, 2) }, "event create")?;
        let event = CudaEvent(ev);
        // SAFETY: a live event and a live stream of the current context.
        check(unsafe { sys::cuEventRecord(event.0, stream_of(s)) }, "event record")?;
        Ok(event)
    }

    fn wait(&self, s: &CudaStream, event: &CudaEvent) -> Result<(), CommError> {
        s.0.make_current()?;
        // SAFETY: a live stream and a live, recorded event of the same context.
        check(unsafe { sys::cuStreamWaitEvent(stream_of(s), event.0, 0) }, "stream wait")
    }

    fn synchronize(&self, s: &CudaStream) -> Result<(), CommError> {
        s.0.stream().synchronize().map_err(QuantError::from)?;
        Ok(())
    }
}
