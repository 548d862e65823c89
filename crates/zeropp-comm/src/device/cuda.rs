//! [`CudaDevice`] (feature `cuda`): the [`Device`] interface on one NVIDIA GPU,
//! through `cust` and zeropp-quant's CUDA kernels (the `*_at` calls of
//! [`Gpu`], on addresses inside this module's allocations).
//!
//! Each stream is a [`Gpu`] handle of its own ([`Gpu::new_stream`]: own CUDA
//! stream, same primary context, the kernels loaded once per context), so each
//! rank of a [`DeviceCluster`](super::DeviceCluster) enqueues on its own stream;
//! events are raw CUDA events (cust's are neither clonable nor waitable by
//! reference), created without timing. Every copy and memset is ordered on a
//! stream of this device, never on the legacy default stream (which would
//! serialise every rank); quantizing calls synchronize their stream (the
//! non-finite check reads a flag back); uploads and downloads synchronize it.
//!
//! Temporaries (realigned encodings) come from a per-stream scratch arena that
//! grows and is reused, not from an allocation per call; a call that uses it
//! synchronizes its stream before returning, and the arena is only replaced
//! after a synchronize, so correctness never depends on `cuMemFree` waiting for
//! queued work. Allocations are padded to whole 4-byte words (the INT4 packing's
//! atomics write words); a 0-byte allocation allocates nothing; memory is freed
//! with the device's context made current first, on whichever thread drops it.
//!
//! This is the only part of the device collectives that needs a GPU to run; CI
//! compiles it (stub driver) and `tests/it/device_gpu.rs` runs it where a GPU is.

use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use zeropp_quant::cuda::cust::memory::{AsyncCopyDestination, DeviceBuffer, DevicePointer, DeviceSlice};
use zeropp_quant::cuda::cust::sys;
use zeropp_quant::cuda::{Elementwise, Gpu, GpuContext, WireAt, padded_bytes};
use zeropp_quant::half::bf16;
use zeropp_quant::{QuantError, encoded_len};

use super::{Device, Elem, Kernel, View};
use crate::CommError;

/// One NVIDIA GPU as a [`Device`].
#[derive(Debug, Clone)]
pub struct CudaDevice {
    /// Keeps the primary context retained for the device's lifetime; its stream
    /// zeroes new allocations.
    gpu: Arc<Gpu>,
}

impl CudaDevice {
    /// Device 0, or the CUDA error (no driver, no device) wrapped in
    /// [`CommError::Quant`].
    pub fn new() -> Result<Self, CommError> {
        Ok(Self { gpu: Arc::new(Gpu::new()?) })
    }

    /// Visible device `ordinal` (see [`Gpu::with_ordinal`]).
    pub fn with_ordinal(ordinal: u32) -> Result<Self, CommError> {
        Ok(Self { gpu: Arc::new(Gpu::with_ordinal(ordinal)?) })
    }

    /// The device of node-local rank `local_rank`: visible device
    /// `local_rank mod (visible devices)` ([`Gpu::for_local_rank`]). Give each
    /// rank of one process its own (NCCL needs one GPU per rank of a communicator).
    pub fn for_local_rank(local_rank: usize) -> Result<Self, CommError> {
        Ok(Self { gpu: Arc::new(Gpu::for_local_rank(local_rank)?) })
    }

    /// The kernels' GPU handle (device name, driver version, loaded image).
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

/// A [`CudaDevice`] allocation (padded to whole words; freed with its context
/// current, on any thread).
#[derive(Debug)]
pub struct CudaMem {
    buf: ManuallyDrop<DeviceBuffer<u8>>,
    ctx: ManuallyDrop<GpuContext>,
}

impl Drop for CudaMem {
    fn drop(&mut self) {
        // The last holder of a buffer lent to other ranks may be another rank's
        // thread: make the context current before the driver frees it.
        let _ = self.ctx.make_current();
        // SAFETY: both fields are dropped once, here, and never used again.
        unsafe {
            ManuallyDrop::drop(&mut self.buf);
            ManuallyDrop::drop(&mut self.ctx);
        }
    }
}

impl CudaMem {
    /// The allocation's device address (0 for an empty allocation).
    pub fn device_addr(&self) -> u64 {
        self.buf.as_device_ptr().as_raw()
    }
}

/// A [`CudaDevice`] stream: a [`Gpu`] handle with its own CUDA stream, and the
/// stream's scratch arena.
#[derive(Debug)]
pub struct CudaStream {
    gpu: Gpu,
    scratch: Mutex<DeviceBuffer<u8>>,
}

impl CudaStream {
    /// The stream's kernel handle.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The scratch arena, at least `bytes` long. Growing it first waits for the
    /// stream, so no queued work still uses the memory that is freed.
    fn scratch(&self, bytes: usize) -> Result<MutexGuard<'_, DeviceBuffer<u8>>, CommError> {
        let mut guard = self.scratch.lock().unwrap_or_else(PoisonError::into_inner);
        if guard.len() < bytes {
            self.gpu.synchronize()?;
            *guard = self.gpu.zeroed_bytes(bytes.next_power_of_two())?;
        }
        Ok(guard)
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
    v.mem().device_addr() + v.offset() as u64
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
    s.gpu.synchronize()?;
    Ok(true)
}

fn stream_of(s: &CudaStream) -> sys::CUstream {
    s.gpu.stream().as_inner()
}

/// Encodings a kernel call reads and writes, each in place when its address is
/// 4-byte aligned (the kernels read and write f32 scales, and INT4 with an odd
/// group size ORs data words) and otherwise through a region of the stream's
/// scratch arena: wire encodings sit back to back in the collectives' buffers,
/// at offsets that need not be multiples of 4.
struct Staged<'s> {
    arena: Option<MutexGuard<'s, DeviceBuffer<u8>>>,
    /// Per encoding: where the kernel sees it.
    at: Vec<WireAt>,
}

impl<'s> Staged<'s> {
    /// Lays out `views` (encodings of `len` elements in their specs); copies the
    /// misaligned inputs (all but the last view when `output`) into the arena.
    fn new(
        s: &'s CudaStream,
        views: &[(View<'_, CudaDevice>, zeropp_quant::QuantSpec)],
        len: usize,
        output: bool,
    ) -> Result<Self, CommError> {
        let mut offsets = Vec::with_capacity(views.len());
        let mut total = 0usize;
        for (v, _) in views {
            if addr(*v).is_multiple_of(4) {
                offsets.push(None);
            } else {
                offsets.push(Some(total));
                total += padded_bytes(v.len());
            }
        }
        let arena = if total > 0 { Some(s.scratch(total)?) } else { None };
        let base = arena.as_ref().map_or(0, |a| a.as_device_ptr().as_raw());
        let inputs = views.len() - usize::from(output);
        let mut at = Vec::with_capacity(views.len());
        for (i, ((v, spec), off)) in views.iter().zip(&offsets).enumerate() {
            let a = match off {
                None => addr(*v),
                Some(o) => {
                    let to = base + *o as u64;
                    if i < inputs {
                        // SAFETY: both ranges are live device memory of `v.len()`
                        // bytes (the arena holds `total`); ordered on the stream.
                        let status =
                            unsafe { sys::cuMemcpyDtoDAsync_v2(to, addr(*v), v.len(), stream_of(s)) };
                        check(status, "copy")?;
                    }
                    to
                }
            };
            at.push(WireAt { addr: a, spec: *spec, len });
        }
        Ok(Self { arena, at })
    }

    /// After the kernel: copies a staged output back to `dst`, then waits for
    /// the stream before the arena is released.
    fn finish(self, s: &CudaStream, dst: Option<View<'_, CudaDevice>>) -> Result<(), CommError> {
        let Some(_arena) = self.arena else { return Ok(()) };
        if let (Some(dst), Some(out)) = (dst, self.at.last())
            && out.addr != addr(dst)
        {
            // SAFETY: both ranges are live device memory of `dst.len()` bytes;
            // ordered on the stream after the kernel.
            let status = unsafe { sys::cuMemcpyDtoDAsync_v2(addr(dst), out.addr, dst.len(), stream_of(s)) };
            check(status, "copy")?;
        }
        s.gpu.synchronize()?;
        Ok(())
    }
}

/// The window's length is `bytes`, else a [`CommError::Mismatch`] naming `what`.
fn need(v: View<'_, CudaDevice>, bytes: usize, what: &str) -> Result<(), CommError> {
    if v.len() == bytes {
        Ok(())
    } else {
        Err(CommError::Mismatch(format!("{what}: window of {} bytes, expected {bytes}", v.len())))
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
        // Zeroed on the device's own stream and waited for (not on the legacy
        // stream); nothing is allocated or set for 0 bytes.
        let buf = self.gpu.zeroed_bytes(bytes)?;
        if bytes > 0 {
            self.gpu.synchronize()?;
        }
        Ok(CudaMem { buf: ManuallyDrop::new(buf), ctx: ManuallyDrop::new(self.gpu.context().clone()) })
    }

    fn stream(&self) -> Result<CudaStream, CommError> {
        let gpu = self.gpu.new_stream()?;
        let scratch = Mutex::new(gpu.zeroed_bytes(0)?);
        Ok(CudaStream { gpu, scratch })
    }

    fn upload(&self, s: &CudaStream, src: &[u8], dst: View<'_, Self>) -> Result<(), CommError> {
        let why = || format!("upload: {} bytes into a window of {}", src.len(), dst.len());
        if !host_copy(s, src.len(), dst.len(), why)? {
            return Ok(());
        }
        // SAFETY: `dst` is a live window of `src.len()` bytes; the slice does not
        // own it; `src` outlives the copy (the stream is synchronized below).
        unsafe {
            let mut d = DeviceSlice::from_raw_parts_mut(DevicePointer::<u8>::from_raw(addr(dst)), dst.len());
            d.async_copy_from(src, s.gpu.stream()).map_err(QuantError::from)?;
        }
        s.gpu.synchronize()?;
        Ok(())
    }

    fn download(&self, s: &CudaStream, src: View<'_, Self>, dst: &mut [u8]) -> Result<(), CommError> {
        let why = || format!("download: window of {} bytes into {}", src.len(), dst.len());
        if !host_copy(s, dst.len(), src.len(), why)? {
            return Ok(());
        }
        // SAFETY: `src` is a live window of `dst.len()` bytes; the slice does not
        // own it; `dst` outlives the copy (the stream is synchronized below).
        unsafe {
            let d = DeviceSlice::from_raw_parts(DevicePointer::<u8>::from_raw(addr(src)), src.len());
            d.async_copy_to(dst, s.gpu.stream()).map_err(QuantError::from)?;
        }
        s.gpu.synchronize()?;
        Ok(())
    }

    fn copy(&self, s: &CudaStream, src: View<'_, Self>, dst: View<'_, Self>) -> Result<(), CommError> {
        if src.len() != dst.len() {
            return Err(CommError::Mismatch(format!("device copy: {} bytes into {}", src.len(), dst.len())));
        }
        if src.is_empty() {
            return Ok(());
        }
        s.gpu.make_current()?;
        // SAFETY: both windows are live device memory of `src.len()` bytes (views
        // are checked against their buffers); ordering is the stream's.
        check(unsafe { sys::cuMemcpyDtoDAsync_v2(addr(dst), addr(src), src.len(), stream_of(s)) }, "copy")
    }

    fn zero(&self, s: &CudaStream, dst: View<'_, Self>) -> Result<(), CommError> {
        if dst.is_empty() {
            return Ok(());
        }
        s.gpu.make_current()?;
        // SAFETY: `dst` is a live window of `dst.len()` bytes.
        check(unsafe { sys::cuMemsetD8Async(addr(dst), 0, dst.len(), stream_of(s)) }, "memset")
    }

    fn kernel(&self, s: &CudaStream, kernel: Kernel<'_, Self>) -> Result<(), CommError> {
        // f32 and bf16 views must be element-aligned: a misaligned access would
        // raise CUDA_ERROR_MISALIGNED_ADDRESS, which poisons the whole context.
        kernel.check_alignment()?;
        let gpu = &s.gpu;
        match kernel {
            Kernel::Quantize { src, elem, spec, opts, dst } => {
                let len = src.len() / elem.size();
                need(src, len * elem.size(), "quantize input")?;
                need(dst, encoded_len(spec, len), "quantize output")?;
                let from = addr(src);
                let staged = Staged::new(s, &[(dst, spec)], len, true)?;
                let out = staged.at[0];
                // SAFETY: `from` addresses `len` live values of the element type
                // and `out` a live encoding (checked lengths, staged if misaligned).
                unsafe {
                    match elem {
                        Elem::F32 => gpu.quantize_at::<f32>(from, &opts, out)?,
                        Elem::Bf16 => gpu.quantize_at::<bf16>(from, &opts, out)?,
                    }
                }
                staged.finish(s, Some(dst))
            }
            Kernel::Dequantize { src, spec, len, dst, add } => {
                need(src, encoded_len(spec, len), "dequantize input")?;
                need(dst, 4 * len, "dequantize output")?;
                let staged = Staged::new(s, &[(src, spec)], len, false)?;
                // SAFETY: the encoding is a live one of `len` elements and `dst`
                // holds `len` f32 (checked).
                unsafe { gpu.dequantize_at(staged.at[0], addr(dst), add)? };
                staged.finish(s, None)
            }
            Kernel::DequantReduceQuant { inputs, len, spec, opts, dst } => {
                for &(v, sp) in inputs {
                    need(v, encoded_len(sp, len), "dequant_reduce_quant input")?;
                }
                need(dst, encoded_len(spec, len), "dequant_reduce_quant output")?;
                let mut views: Vec<_> = inputs.to_vec();
                views.push((dst, spec));
                let staged = Staged::new(s, &views, len, true)?;
                let (ins, out) = staged.at.split_at(inputs.len());
                // SAFETY: every input is a live encoding of `len` elements and the
                // output a live encoding (checked, staged when misaligned).
                unsafe { gpu.dequant_reduce_quant_at(ins, &opts, out[0])? };
                staged.finish(s, Some(dst))
            }
            Kernel::Add { src, elem, dst } => {
                let n = dst.len() / 4;
                need(src, n * elem.size(), "add")?;
                let (src, acc) = (addr(src), addr(dst));
                let op = match elem {
                    Elem::F32 => Elementwise::AddF32 { src, acc },
                    Elem::Bf16 => Elementwise::AddBf16 { src, acc },
                };
                // SAFETY: `n` live, aligned elements at both addresses (checked).
                unsafe { gpu.elementwise_at(op, n)? };
                Ok(())
            }
            Kernel::Div { buf, by } => {
                // SAFETY: `buf` holds `len / 4` live, aligned f32.
                unsafe { gpu.elementwise_at(Elementwise::DivF32 { x: addr(buf), by }, buf.len() / 4)? };
                Ok(())
            }
            Kernel::Hadamard { buf, h, position, inverse } => {
                // SAFETY: `buf` holds `len / 4` live, aligned f32.
                unsafe { gpu.hadamard_at(addr(buf), buf.len() / 4, &h, position, inverse)? };
                Ok(())
            }
            Kernel::Feedback { comp, deq, res, beta } => {
                let n = res.len() / 4;
                need(comp, 4 * n, "feedback")?;
                need(deq, 4 * n, "feedback")?;
                let op = Elementwise::Feedback { comp: addr(comp), deq: addr(deq), res: addr(res), beta };
                // SAFETY: `n` live, aligned f32 at each address (checked).
                unsafe { gpu.elementwise_at(op, n)? };
                Ok(())
            }
            Kernel::FromBf16 { src, dst } => {
                let n = dst.len() / 4;
                need(src, 2 * n, "from_bf16")?;
                if n == 0 {
                    return Ok(());
                }
                s.gpu.make_current()?;
                // -0.0 is the additive identity of IEEE f32 (-0 + x = x for every x,
                // -0 included), so adding the bf16 values to it widens them exactly.
                // SAFETY: `dst` is a live window of `n` aligned f32 (checked).
                check(unsafe { sys::cuMemsetD32Async(addr(dst), 0x8000_0000, n, stream_of(s)) }, "memset")?;
                // SAFETY: `n` live bf16 and `n` live f32, aligned (checked).
                unsafe { gpu.elementwise_at(Elementwise::AddBf16 { src: addr(src), acc: addr(dst) }, n)? };
                Ok(())
            }
            Kernel::ToBf16 { src, dst } => {
                let n = src.len() / 4;
                need(dst, 2 * n, "to_bf16")?;
                // SAFETY: `n` live f32 and `n` live bf16, aligned (checked).
                unsafe { gpu.elementwise_at(Elementwise::ToBf16 { src: addr(src), out: addr(dst) }, n)? };
                Ok(())
            }
        }
    }

    fn record(&self, s: &CudaStream) -> Result<CudaEvent, CommError> {
        s.gpu.make_current()?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: `ev` is a valid out-pointer; flag 2 = CU_EVENT_DISABLE_TIMING.
        check(unsafe { sys::cuEventCreate(&mut ev, 2) }, "event create")?;
        let event = CudaEvent(ev);
        // SAFETY: a live event and a live stream of the current context.
        check(unsafe { sys::cuEventRecord(event.0, stream_of(s)) }, "event record")?;
        Ok(event)
    }

    fn wait(&self, s: &CudaStream, event: &CudaEvent) -> Result<(), CommError> {
        s.gpu.make_current()?;
        // SAFETY: a live stream and a live, recorded event of the same context.
        check(unsafe { sys::cuStreamWaitEvent(stream_of(s), event.0, 0) }, "stream wait")
    }

    fn synchronize(&self, s: &CudaStream) -> Result<(), CommError> {
        // On any thread: the context is made current first.
        s.gpu.synchronize()?;
        Ok(())
    }
}
