//! GPU kernels (feature `cuda`): quantize, dequantize, dequantize-add and the
//! fused qgZ `dequant_reduce_quant` on an NVIDIA GPU, through `cust`.
//!
//! Every result is **bit-identical** to the CPU scalar kernels (and so to every
//! CPU kernel): the CUDA C++ in `crates/zeropp-quant/cuda/zeropp_quant.cu`
//! evaluates the same f32 formulas in the same order, with each float operation
//! an explicit round-to-nearest intrinsic and FMA contraction off; stochastic
//! rounding uses the same counter-based RNG keyed by `(seed, element index)`.
//! bf16 and f16 inputs are converted to f32 exactly, and the fused kernel sums in
//! f32 in input order.
//!
//! Quantized values live on the device in the [wire layout](crate::wire)
//! ([`GpuQuantized`]): a GPU rank's message decodes on a CPU rank
//! ([`GpuQuantized::to_bytes`]) and a CPU rank's wire bytes feed the GPU kernels
//! ([`Gpu::upload_wire`]).
//!
//! The kernels are embedded precompiled (`cargo xtask ptx` regenerates them):
//! sm_80 and sm_90 cubins (Ampere/Ada and Hopper; built by CUDA 12.4, so R525+
//! drivers should load them by NVIDIA's minor-version compatibility)
//! and PTX ISA 8.4 for `compute_70`, which the driver JIT-compiles for other GPUs
//! (Volta and newer; needs an R550+ driver). No CUDA toolkit is needed to build.
//!
//! Every call is synchronous (it waits for its own stream). [`Gpu::new`] takes
//! device 0, [`Gpu::with_ordinal`] any visible device, and [`Gpu::for_local_rank`]
//! maps a node-local rank onto the visible devices (`CUDA_VISIBLE_DEVICES`
//! already renumbers them from 0). A [`Gpu`] makes its context current on the
//! calling thread at each call, and [`GpuVec`] and [`GpuQuantized`] make it
//! current before they free their memory, so they may be dropped on any thread.
//! [`Gpu::new_stream`] gives another handle on the same device with its own
//! stream, sharing the loaded kernels (one module per context, not one per
//! stream). Memsets and copies of the calls are ordered on the handle's
//! stream, never on the legacy default stream, so handles on several threads do
//! not serialise each other; allocations are padded to whole 4-byte words (the
//! INT4 packing's atomics write words) and a zero-length buffer allocates nothing.
//!
//! ```no_run
//! use zeropp_quant::cuda::Gpu;
//! use zeropp_quant::{Options, QuantSpec, Quantized};
//! let gpu = Gpu::new()?;
//! let x: Vec<f32> = (0..4096).map(|i| (i as f32).sin()).collect();
//! let q = gpu.quantize(&gpu.upload(&x)?, QuantSpec::int8(256)?, &Options::default())?;
//! // The GPU's wire bytes are exactly the CPU's.
//! let cpu = zeropp_quant::quantize(&x, QuantSpec::int8(256)?, &Options::default())?;
//! assert_eq!(q.to_bytes()?, cpu.to_bytes());
//! # Ok::<(), zeropp_quant::QuantError>(())
//! ```

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, PoisonError};

use cust::context::{Context, CurrentContext};
use cust::device::{Device, DeviceAttribute};
use cust::launch;
use cust::memory::{
    AsyncCopyDestination, CopyDestination, DeviceBox, DeviceBuffer, DeviceCopy, DevicePointer, DeviceSlice,
};
use cust::module::Module;
use cust::stream::{Stream, StreamFlags};
use half::{bf16, f16};

pub use cust;

use crate::element::Element;
use crate::error::{QuantError, Result};
use crate::quantized::{AsQuantizedRef, Quantized, QuantizedRef};
use crate::spec::{Bits, Options, QuantSpec, Rounding};
use crate::wire;

/// PTX (ISA 8.4, `compute_70`) of the kernels: the fallback for GPUs without a cubin.
static PTX: &str = include_str!("../../cuda/zeropp_quant.ptx");
/// SASS for compute capability 8.x (A100, A10, L4, L40, RTX 30/40).
static SM80: &[u8] = include_bytes!("../../cuda/zeropp_quant.sm_80.cubin");
/// SASS for compute capability 9.0 (H100, H200, GH200).
static SM90: &[u8] = include_bytes!("../../cuda/zeropp_quant.sm_90.cubin");

/// Threads per block (the kernels' `__launch_bounds__`).
const BLOCK: u32 = 256;
/// Most blocks per launch; blocks loop over the remaining groups.
const MAX_BLOCKS: usize = 1 << 20;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// An input element type of the GPU quantizer: `f32`, `bf16` or `f16`.
pub trait GpuElement: Element + sealed::Sealed {
    /// The type stored on the device (`f32`, or the 16 raw bits of a half type).
    type Raw: DeviceCopy;
    /// The quantize kernel for this type.
    #[doc(hidden)]
    const QUANTIZE: &'static str;
    /// The kernel returning one element as f32.
    #[doc(hidden)]
    const VALUE: &'static str;
    /// The device representation.
    fn raw(self) -> Self::Raw;
}

impl GpuElement for f32 {
    type Raw = f32;
    const QUANTIZE: &'static str = "zq_quantize_f32";
    const VALUE: &'static str = "zq_value_f32";
    fn raw(self) -> f32 {
        self
    }
}

/// [`GpuElement`] for the 16-bit `half` types: their bits, and the kernels named
/// after the type.
macro_rules! half_element {
    ($($t:ident),*) => {$(
        impl GpuElement for $t {
            type Raw = u16;
            const QUANTIZE: &'static str = concat!("zq_quantize_", stringify!($t));
            const VALUE: &'static str = concat!("zq_value_", stringify!($t));
            fn raw(self) -> u16 {
                self.to_bits()
            }
        }
    )*};
}

half_element!(bf16, f16);

/// A handle on a GPU's (primary) context: [`GpuContext::make_current`] makes it
/// the calling thread's current context. Device buffers of this module keep one,
/// so they can be freed on any thread.
#[derive(Debug, Clone)]
pub struct GpuContext(Arc<Context>);

impl GpuContext {
    /// Makes this context current on the calling thread.
    pub fn make_current(&self) -> Result<()> {
        CurrentContext::set_current(&*self.0)?;
        Ok(())
    }
}

/// `bytes` rounded up to whole 4-byte words: the size of every device
/// allocation of encodings (the INT4 packing's atomics OR whole words, so the
/// last word of an odd-sized encoding must be inside the allocation).
pub fn padded_bytes(bytes: usize) -> usize {
    bytes.div_ceil(4).saturating_mul(4)
}

/// `len` uninitialised device elements; no allocation (and no driver call) when
/// `len` is 0. The context must be current.
fn alloc<T: DeviceCopy>(len: usize) -> Result<DeviceBuffer<T>> {
    // SAFETY: `uninitialized(0)` makes a null buffer without calling the driver;
    // otherwise the memory is written before it is read by every caller (a
    // stream-ordered memset or copy, or a kernel that writes every element).
    Ok(unsafe { DeviceBuffer::uninitialized(len)? })
}

/// A vector of `T` in device memory (input of [`Gpu::quantize`]).
#[derive(Debug)]
pub struct GpuVec<T: GpuElement> {
    buf: ManuallyDrop<DeviceBuffer<T::Raw>>,
    ctx: ManuallyDrop<GpuContext>,
    _t: PhantomData<T>,
}

impl<T: GpuElement> Drop for GpuVec<T> {
    fn drop(&mut self) {
        // Free on any thread: the buffer's context first.
        let _ = self.ctx.make_current();
        // SAFETY: both fields are dropped once, here, and never used again.
        unsafe {
            ManuallyDrop::drop(&mut self.buf);
            ManuallyDrop::drop(&mut self.ctx);
        }
    }
}

impl<T: GpuElement> GpuVec<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The device buffer (raw bits for the half types).
    pub fn buffer(&self) -> &DeviceBuffer<T::Raw> {
        &self.buf
    }

    /// The device buffer, by value (for example an f32 accumulator for
    /// [`Gpu::dequantize_add`]). Drop it where the GPU's context is current
    /// (after any call of its [`Gpu`] on that thread, or [`Gpu::make_current`]).
    pub fn into_buffer(self) -> DeviceBuffer<T::Raw> {
        let mut me = ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped; each field is taken or dropped once.
        unsafe {
            ManuallyDrop::drop(&mut me.ctx);
            ManuallyDrop::take(&mut me.buf)
        }
    }
}

/// A quantized vector in device memory, in the [wire layout](crate::wire):
/// header, scales, offsets (asymmetric), packed data. The allocation is padded
/// to whole 4-byte words ([`padded_bytes`]); the encoding is its first
/// [`GpuQuantized::encoded_len`] bytes.
#[derive(Debug)]
pub struct GpuQuantized {
    spec: QuantSpec,
    len: usize,
    /// The encoding's bytes (the allocation may be up to 3 bytes longer).
    bytes: usize,
    buf: ManuallyDrop<DeviceBuffer<u8>>,
    ctx: ManuallyDrop<GpuContext>,
}

impl Drop for GpuQuantized {
    fn drop(&mut self) {
        let _ = self.ctx.make_current();
        // SAFETY: both fields are dropped once, here, and never used again.
        unsafe {
            ManuallyDrop::drop(&mut self.buf);
            ManuallyDrop::drop(&mut self.ctx);
        }
    }
}

/// One quantized input as the kernels see it (`struct InDesc` in the `.cu` file).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct InDesc {
    data: u64,
    scales: u64,
    offsets: u64,
    group_size: u32,
    bits: u32,
}

// SAFETY: plain integers (device addresses, sizes) with a C layout; no host
// pointers or references.
unsafe impl DeviceCopy for InDesc {}

impl GpuQuantized {
    crate::quantized::shape_accessors!();

    /// Size of the wire encoding.
    pub fn encoded_len(&self) -> usize {
        self.bytes
    }

    /// The device bytes of the wire encoding (what a GPU rank sends).
    pub fn buffer(&self) -> DeviceSlice<u8> {
        self.buf.index(..self.bytes)
    }

    /// The encoding by address, for the `*_at` calls of [`Gpu`].
    pub fn at(&self) -> WireAt {
        WireAt { addr: self.buf.as_device_ptr().as_raw(), spec: self.spec, len: self.len }
    }

    /// Copies the wire encoding to the host (on any thread: the context is made
    /// current first; the copy waits for the device).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        self.ctx.make_current()?;
        let mut v = vec![0u8; self.bytes];
        self.buffer().copy_to(&mut v[..])?;
        Ok(v)
    }

    /// Copies to the host and decodes (with every check of
    /// [`Quantized::from_bytes`]).
    pub fn to_quantized(&self) -> Result<Quantized> {
        Quantized::from_bytes(&self.to_bytes()?)
    }
}

/// The kernels' view of a wire encoding of `len` elements in `spec` at device address `base`.
fn desc_at(base: u64, spec: &QuantSpec, len: usize) -> InDesc {
    let groups = spec.num_groups(len) as u64;
    let scales = base + wire::HEADER_LEN as u64;
    let (offsets, data) = if spec.scheme().has_offsets() {
        (scales + 4 * groups, scales + 8 * groups)
    } else {
        (0, scales + 4 * groups)
    };
    InDesc { data, scales, offsets, group_size: spec.group_size() as u32, bits: spec.bits().bits() }
}

/// A wire encoding in device memory the caller manages, by address: `len`
/// elements in `spec` laid out as the [wire encoding](crate::wire) starting at
/// `addr` (header included). For callers that keep many encodings in one
/// allocation (zeropp-comm's device collectives); see [`Gpu::quantize_at`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WireAt {
    /// Device address of the encoding's first (header) byte.
    pub addr: u64,
    /// Its format.
    pub spec: QuantSpec,
    /// Its elements.
    pub len: usize,
}

/// One GPU with the kernels loaded, and a stream of its own.
///
/// [`Gpu::new`] fails with [`QuantError::Cuda`] when there is no driver or no
/// device (the stub `libcuda.so.1` that `cargo xtask` builds for linking
/// answers `NoDevice`).
#[derive(Debug)]
pub struct Gpu {
    // Declaration order is drop order, and `Drop` makes the context current
    // first: the stream and buffers, then the module, then the context.
    stream: Stream,
    /// The quantize kernels' first non-finite index (one u64, reused).
    bad: DeviceBuffer<u64>,
    /// The fused kernel's input descriptors (grown as needed, reused).
    descs: Mutex<DeviceBuffer<InDesc>>,
    module: Arc<Module>,
    device: Device,
    ordinal: u32,
    image: &'static str,
    ctx: GpuContext,
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // The fields free device memory and destroy the stream next: on this
        // handle's context, whichever thread drops it.
        let _ = self.ctx.make_current();
    }
}

/// `cuInit`, its failure named (no driver, or the stub `libcuda` first on the path).
fn init() -> Result<()> {
    cust::init(cust::CudaFlags::empty()).map_err(at("cuInit"))
}

/// Wraps a driver error as [`QuantError::CudaCall`] naming `call`.
fn at(call: &'static str) -> impl Fn(cust::error::CudaError) -> QuantError {
    move |source| QuantError::CudaCall { call, source }
}

impl Gpu {
    /// Initialises CUDA, retains device 0's primary context and loads the
    /// kernels: the cubin for the device's architecture, else the PTX.
    pub fn new() -> Result<Self> {
        Self::with_ordinal(0)
    }

    /// [`Gpu::new`] on visible device `ordinal` (0-based among the devices
    /// `CUDA_VISIBLE_DEVICES` leaves visible).
    pub fn with_ordinal(ordinal: u32) -> Result<Self> {
        init()?;
        let device = Device::get_device(ordinal).map_err(at("cuDeviceGet (the device)"))?;
        let ctx =
            GpuContext(Arc::new(Context::new(device).map_err(at("cuDevicePrimaryCtxRetain (the context)"))?));
        let major = device
            .get_attribute(DeviceAttribute::ComputeCapabilityMajor)
            .map_err(at("cuDeviceGetAttribute (compute capability)"))?;
        let cubin = match major {
            8 => Some(("sm_80 cubin", SM80)),
            9 => Some(("sm_90 cubin", SM90)),
            _ => None,
        };
        let loaded = match cubin {
            Some((name, bytes)) => Module::from_cubin(bytes, &[]).map(|m| (name, m)).map_err(Some),
            None => Err(None),
        };
        let (image, module) = match loaded {
            Ok(x) => x,
            Err(cubin_error) => {
                let module = Module::from_ptx(PTX, &[]).map_err(|source| QuantError::CudaCall {
                    // Name the cubin's failure too: the JIT is only the fallback.
                    call: if cubin_error.is_some() {
                        "cuModuleLoadData (module load: PTX JIT, after the cubin load failed)"
                    } else {
                        "cuModuleLoadData (module load: PTX JIT)"
                    },
                    source,
                })?;
                ("PTX (JIT-compiled by the driver)", module)
            }
        };
        Self::on(ctx, device, ordinal, Arc::new(module), image)
    }

    /// The device for node-local rank `local_rank`: visible device
    /// `local_rank mod (visible devices)`, so the ranks of a node spread over
    /// its GPUs (with `CUDA_VISIBLE_DEVICES=a,b,…`, over those).
    pub fn for_local_rank(local_rank: usize) -> Result<Self> {
        init()?;
        let count = Device::num_devices().map_err(at("cuDeviceGetCount"))?.max(1) as usize;
        Self::with_ordinal((local_rank % count) as u32)
    }

    /// Number of devices the driver shows this process (0 without a driver).
    pub fn device_count() -> usize {
        cust::init(cust::CudaFlags::empty()).and_then(|()| Device::num_devices()).map_or(0, |n| n as usize)
    }

    /// Another handle on this device with a stream of its own, sharing the
    /// context and the loaded kernels (no second module load).
    pub fn new_stream(&self) -> Result<Self> {
        self.current()?;
        Self::on(self.ctx.clone(), self.device, self.ordinal, Arc::clone(&self.module), self.image)
    }

    /// A handle on `ctx` (current on this thread) with its own stream and buffers.
    fn on(
        ctx: GpuContext,
        device: Device,
        ordinal: u32,
        module: Arc<Module>,
        image: &'static str,
    ) -> Result<Self> {
        ctx.make_current()?;
        // A blocking stream: should any work still land on the legacy default
        // stream, it stays ordered with this one. This module puts none there.
        let stream = Stream::new(StreamFlags::DEFAULT, None)?;
        let bad = alloc::<u64>(1)?;
        let descs = Mutex::new(alloc::<InDesc>(0)?);
        Ok(Self { stream, bad, descs, module, device, ordinal, image, ctx })
    }

    /// The device's name.
    pub fn device_name(&self) -> Result<String> {
        Ok(self.device.name()?)
    }

    /// The device's ordinal among the visible devices.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The driver's CUDA version, e.g. `12040` for 12.4.
    pub fn driver_version(&self) -> Result<i32> {
        Ok(cust::CudaApiVersion::get().map(|v| v.major() * 1000 + v.minor() * 10)?)
    }

    /// Which embedded image was loaded (`sm_80 cubin`, `sm_90 cubin` or PTX).
    pub fn image(&self) -> &'static str {
        self.image
    }

    /// The stream every call runs on (for timing with events).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// This GPU's context, for device memory that must be freed on any thread.
    pub fn context(&self) -> &GpuContext {
        &self.ctx
    }

    fn current(&self) -> Result<()> {
        self.ctx.make_current()
    }

    /// Makes this GPU's (primary) context current on the calling thread, for
    /// callers that allocate or copy through `cust` directly.
    pub fn make_current(&self) -> Result<()> {
        self.current()
    }

    /// Waits for this handle's stream, with its context current.
    pub fn synchronize(&self) -> Result<()> {
        self.current()?;
        self.stream.synchronize()?;
        Ok(())
    }

    /// `bytes` bytes of zeroed device memory padded to whole words
    /// ([`padded_bytes`]), zeroed on this handle's stream (stream-ordered, not
    /// on the legacy stream); nothing is allocated for 0 bytes. Later work on
    /// this stream sees the zeros; other streams must wait for it.
    pub fn zeroed_bytes(&self, bytes: usize) -> Result<DeviceBuffer<u8>> {
        self.current()?;
        let mut b = alloc::<u8>(padded_bytes(bytes))?;
        if !b.is_empty() {
            // SAFETY: `b` is a live allocation of this context; the memset is
            // ordered on this stream before any use the callers make of it.
            unsafe { b.set_zero_async(&self.stream)? };
        }
        Ok(b)
    }

    /// Copies `x` into new device memory on this stream and waits for it.
    fn copy_to_device<T: DeviceCopy>(&self, x: &[T]) -> Result<DeviceBuffer<T>> {
        let mut b = alloc::<T>(x.len())?;
        if !x.is_empty() {
            // SAFETY: `b` holds `x.len()` elements; the stream is synchronized
            // before `x` can go away.
            unsafe { b.async_copy_from(x, &self.stream)? };
            self.stream.synchronize()?;
        }
        Ok(b)
    }

    /// Copies `x` to the device.
    pub fn upload<T: GpuElement>(&self, x: &[T]) -> Result<GpuVec<T>> {
        self.current()?;
        let raw: Vec<T::Raw> = x.iter().map(|&v| v.raw()).collect();
        Ok(GpuVec {
            buf: ManuallyDrop::new(self.copy_to_device(&raw)?),
            ctx: ManuallyDrop::new(self.ctx.clone()),
            _t: PhantomData,
        })
    }

    /// Copies a device f32 buffer to the host, after this stream's earlier work.
    pub fn download(&self, x: &DeviceSlice<f32>) -> Result<Vec<f32>> {
        self.current()?;
        let mut v = vec![0f32; x.len()];
        if !x.is_empty() {
            // SAFETY: `v` holds `x.len()` floats and outlives the copy: the stream
            // is synchronized before it is returned.
            unsafe { x.async_copy_to(&mut v[..], &self.stream)? };
            self.stream.synchronize()?;
        }
        Ok(v)
    }

    /// Copies a quantized value (owned or a view of received wire bytes) to the device.
    pub fn upload_quantized<Q: AsQuantizedRef + ?Sized>(&self, q: &Q) -> Result<GpuQuantized> {
        let q = q.as_quantized_ref();
        self.wire_buffer(q.spec(), q.len(), &q.to_bytes())
    }

    /// Checks wire bytes (every check of [`QuantizedRef::from_bytes`]) and copies them to the device.
    pub fn upload_wire(&self, bytes: &[u8]) -> Result<GpuQuantized> {
        let q = QuantizedRef::from_bytes(bytes)?;
        self.wire_buffer(q.spec(), q.len(), bytes)
    }

    /// A padded device copy of the encoding `bytes` (`len` elements in `spec`).
    fn wire_buffer(&self, spec: QuantSpec, len: usize, bytes: &[u8]) -> Result<GpuQuantized> {
        self.current()?;
        let mut padded = bytes.to_vec();
        padded.resize(padded_bytes(bytes.len()), 0);
        Ok(GpuQuantized {
            spec,
            len,
            bytes: bytes.len(),
            buf: ManuallyDrop::new(self.copy_to_device(&padded)?),
            ctx: ManuallyDrop::new(self.ctx.clone()),
        })
    }

    /// A device buffer of `len` f32 zeros (a destination for dequantization),
    /// zeroed on this stream; nothing is allocated when `len` is 0. Drop it where
    /// this GPU's context is current (any call of this [`Gpu`] makes it current).
    pub fn zeros(&self, len: usize) -> Result<DeviceBuffer<f32>> {
        self.current()?;
        let mut b = alloc::<f32>(len)?;
        if len > 0 {
            // SAFETY: a live allocation of this context, zeroed in stream order
            // and waited for before it is returned.
            unsafe { b.set_zero_async(&self.stream)? };
            self.stream.synchronize()?;
        }
        Ok(b)
    }

    /// A quantized destination of `len` elements in `spec` on the device: the
    /// header is written, the rest is zero (not a valid value until a
    /// `*_into` call fills it). For [`Gpu::quantize_into`] and
    /// [`Gpu::dequant_reduce_quant_into`], which reuse it without allocating.
    pub fn quantized_buffer(&self, spec: QuantSpec, len: usize) -> Result<GpuQuantized> {
        let total = wire::checked_encoded_len(&spec, len).ok_or(QuantError::TooLarge(len as u64))?;
        let mut bytes = vec![0u8; total];
        let header = bytes.get_mut(..wire::HEADER_LEN).ok_or(QuantError::TooLarge(len as u64))?;
        wire::write_header(header, &spec, len)?;
        self.wire_buffer(spec, len, &bytes)
    }

    /// Quantizes `x` group by group, like [`crate::quantize`] (only
    /// `opts.rounding` is read: the kernel and threading options are CPU ones).
    ///
    /// Errors with [`QuantError::NonFinite`] naming the first NaN/±Inf element.
    pub fn quantize<T: GpuElement>(
        &self,
        x: &GpuVec<T>,
        spec: QuantSpec,
        opts: &Options,
    ) -> Result<GpuQuantized> {
        let mut out = self.quantized_buffer(spec, x.len())?;
        self.quantize_into(x, opts, &mut out)?;
        Ok(out)
    }

    /// [`Gpu::quantize`] into `out` (its spec is the format; its length must
    /// equal `x.len()`), without allocating the output.
    pub fn quantize_into<T: GpuElement>(
        &self,
        x: &GpuVec<T>,
        opts: &Options,
        out: &mut GpuQuantized,
    ) -> Result<()> {
        if out.len != x.len() {
            return Err(QuantError::LengthMismatch {
                what: "quantize_into output",
                expected: x.len(),
                actual: out.len,
            });
        }
        self.current()?;
        // SAFETY: `x` holds `out.len` live values of `T` (checked above) and `out`
        // a live encoding of its spec and length, both made on this context.
        unsafe { self.launch_quantize::<T>(x.buf.as_device_ptr().as_raw(), opts, out.at()) }
    }

    /// The quantize kernel of [`Gpu::quantize_into`] and [`Gpu::quantize_at`]
    /// (the header is the callers'), synchronized.
    ///
    /// # Safety
    ///
    /// As [`Gpu::quantize_at`]; the context is current.
    unsafe fn launch_quantize<T: GpuElement>(&self, src: u64, opts: &Options, out: WireAt) -> Result<()> {
        self.run_quantize(
            out,
            opts,
            |bad| self.value(T::VALUE, src, None, bad),
            |m, a| {
                let f = m.get_function(T::QUANTIZE)?;
                let stream = &self.stream;
                let (grid, block) = (a.grid, BLOCK);
                // SAFETY: the argument list matches `zq_quantize_*`'s parameters in
                // order and type (device addresses as u64); every address points
                // into a live buffer of the sizes the kernel indexes (`len` inputs,
                // the output's wire layout, one u64) by this function's contract.
                unsafe {
                    launch!(f<<<grid, block, 0, stream>>>(
                        src, a.len, a.gs, a.bits, a.asym, a.stochastic, a.seed, a.atomic_pack,
                        a.scales, a.offsets, a.data, a.bad
                    ))?;
                }
                Ok(())
            },
        )
    }

    /// The fused qgZ kernel, like [`crate::dequant_reduce_quant`]: dequantizes
    /// the inputs (equal lengths, any specs), sums them in f32 in input order and
    /// requantizes with `out_spec`.
    pub fn dequant_reduce_quant(
        &self,
        inputs: &[&GpuQuantized],
        out_spec: QuantSpec,
        opts: &Options,
    ) -> Result<GpuQuantized> {
        let len = inputs.first().ok_or(QuantError::NoInputs)?.len;
        let mut out = self.quantized_buffer(out_spec, len)?;
        self.dequant_reduce_quant_into(inputs, opts, &mut out)?;
        Ok(out)
    }

    /// [`Gpu::dequant_reduce_quant`] into `out` (its spec is the output spec;
    /// its length must equal the inputs'), without allocating the output.
    pub fn dequant_reduce_quant_into(
        &self,
        inputs: &[&GpuQuantized],
        opts: &Options,
        out: &mut GpuQuantized,
    ) -> Result<()> {
        let len = inputs.first().ok_or(QuantError::NoInputs)?.len;
        for q in inputs.iter().chain(std::iter::once(&&*out)) {
            if q.len != len {
                return Err(QuantError::LengthMismatch {
                    what: "dequant_reduce_quant input or output",
                    expected: len,
                    actual: q.len,
                });
            }
        }
        self.current()?;
        let inputs: Vec<WireAt> = inputs.iter().map(|q| q.at()).collect();
        // SAFETY: every input and `out` is a live encoding of its spec and length
        // (all `len`, checked above), made on this context.
        unsafe { self.launch_reduce_quantize(&inputs, opts, out.at()) }
    }

    /// The fused kernel of [`Gpu::dequant_reduce_quant_into`] and
    /// [`Gpu::dequant_reduce_quant_at`] (the header is the callers'), synchronized.
    ///
    /// # Safety
    ///
    /// As [`Gpu::dequant_reduce_quant_at`]; the context is current.
    unsafe fn launch_reduce_quantize(&self, inputs: &[WireAt], opts: &Options, out: WireAt) -> Result<()> {
        let host: Vec<InDesc> = inputs.iter().map(|q| desc_at(q.addr, &q.spec, q.len)).collect();
        // The descriptors go to a reused buffer on this stream (no allocation per
        // call once it is large enough); `run_quantize` synchronizes the stream
        // before `host` and the lock go away.
        let mut descs = self.descs.lock().unwrap_or_else(PoisonError::into_inner);
        if descs.len() < host.len() {
            *descs = alloc::<InDesc>(host.len().next_power_of_two())?;
        }
        let mut window = descs.index(..host.len());
        // SAFETY: `window` holds `host.len()` descriptors of a live allocation;
        // the copy is ordered before the kernel on this stream, and the stream is
        // synchronized before `host` is dropped.
        unsafe { window.async_copy_from(&host[..], &self.stream)? };
        let (din, k) = (window.as_device_ptr().as_raw(), inputs.len() as u32);
        self.run_quantize(
            out,
            opts,
            |bad| self.value("zq_value_sum", din, Some(k), bad),
            |m, a| {
                let f = m.get_function("zq_reduce_quantize")?;
                let stream = &self.stream;
                let (grid, block) = (a.grid, BLOCK);
                // SAFETY: the arguments match `zq_reduce_quantize`'s parameters;
                // `din` holds `k` descriptors of live encodings of length `len`, and
                // the output addresses are live, by this function's contract.
                unsafe {
                    launch!(f<<<grid, block, 0, stream>>>(
                        din, k, a.len, a.gs, a.bits, a.asym, a.stochastic, a.seed, a.atomic_pack,
                        a.scales, a.offsets, a.data, a.bad
                    ))?;
                }
                Ok(())
            },
        )
    }

    /// Shared part of the quantizing calls: arguments, launch, synchronisation
    /// and the non-finite check.
    fn run_quantize(
        &self,
        out: WireAt,
        opts: &Options,
        value_at: impl Fn(u64) -> Result<f32>,
        launch_fn: impl Fn(&Module, &QuantLaunch) -> Result<()>,
    ) -> Result<()> {
        if out.len == 0 {
            return Ok(());
        }
        let spec = out.spec;
        let d = desc_at(out.addr, &spec, out.len);
        let atomic_pack = spec.bits() == Bits::Int4 && spec.group_size() % 2 == 1;
        if atomic_pack {
            // INT4 with an odd group size ORs each group's nibbles into the data,
            // word by word: the data must start 4-byte aligned and be zeroed.
            if !d.data.is_multiple_of(4) {
                return Err(QuantError::Cuda(cust::error::CudaError::InvalidValue));
            }
            // SAFETY: `d.data` addresses the output's data region of `⌈len/2⌉`
            // bytes in live device memory (the callers' contract); the slice
            // does not own it (dropping it frees nothing). The memset is ordered
            // on this stream before the kernel.
            unsafe {
                let mut data = DeviceSlice::from_raw_parts_mut(
                    DevicePointer::<u8>::from_raw(d.data),
                    out.len.div_ceil(2),
                );
                data.set_zero_async(&self.stream)?;
            }
        }
        // All ones = u64::MAX: no non-finite element seen yet. Ordered on this
        // stream (the previous call's read-back finished before it returned).
        // SAFETY: `bad` is a live allocation of this context.
        unsafe { self.bad.index(..).set_8_async(0xFF, &self.stream)? };
        let (stochastic, seed) = match opts.rounding {
            Rounding::Stochastic { seed } => (1u32, seed),
            Rounding::NearestEven => (0u32, 0u64),
        };
        let groups = spec.num_groups(out.len);
        let a = QuantLaunch {
            grid: groups.min(MAX_BLOCKS) as u32,
            len: out.len as u64,
            gs: spec.group_size() as u32,
            bits: spec.bits().bits(),
            asym: u32::from(spec.scheme().has_offsets()),
            stochastic,
            seed,
            atomic_pack: u32::from(atomic_pack),
            scales: d.scales,
            offsets: d.offsets,
            data: d.data,
            bad: self.bad.as_device_ptr().as_raw(),
        };
        launch_fn(&self.module, &a)?;
        let mut first = [0u64];
        // SAFETY: `first` outlives the copy: the stream is synchronized next.
        unsafe { self.bad.async_copy_to(&mut first[..], &self.stream)? };
        self.stream.synchronize()?;
        let first_bad = first[0];
        if first_bad != u64::MAX {
            let value = value_at(first_bad)?;
            return Err(QuantError::NonFinite { index: first_bad as usize, value });
        }
        Ok(())
    }

    /// Element `i` of a quantize source as f32 (`k` inputs for the fused kernel).
    fn value(&self, kernel: &str, src: u64, k: Option<u32>, i: u64) -> Result<f32> {
        // Only on the error path: a synchronous allocation is fine here.
        let out = DeviceBox::new(&0f32)?;
        let o = out.as_device_ptr().as_raw();
        let f = self.module.get_function(kernel)?;
        let stream = &self.stream;
        // SAFETY: `zq_value_*(src, i, out)` / `zq_value_sum(in, k, i, out)`: `i`
        // is an index the quantize kernel just read from `src`, `out` one f32.
        unsafe {
            match k {
                Some(k) => launch!(f<<<1, 1, 0, stream>>>(src, k, i, o))?,
                None => launch!(f<<<1, 1, 0, stream>>>(src, i, o))?,
            }
        }
        self.stream.synchronize()?;
        let mut v = 0f32;
        out.copy_to(&mut v)?;
        Ok(v)
    }

    /// Dequantizes into a new device buffer, like [`crate::dequantize`] (drop
    /// it where this GPU's context is current).
    pub fn dequantize(&self, q: &GpuQuantized) -> Result<DeviceBuffer<f32>> {
        self.current()?;
        // The kernel writes every element.
        let mut out = alloc::<f32>(q.len)?;
        self.dequant(q, &mut out, false)?;
        Ok(out)
    }

    /// Dequantizes into `out` (length `q.len()`), like [`crate::dequantize_into`].
    pub fn dequantize_into(&self, q: &GpuQuantized, out: &mut DeviceSlice<f32>) -> Result<()> {
        self.current()?;
        self.dequant(q, out, false)
    }

    /// Accumulates the dequantized values into `acc` (`acc[i] += x̂[i]` in f32),
    /// like [`crate::dequantize_add`].
    pub fn dequantize_add(&self, q: &GpuQuantized, acc: &mut DeviceSlice<f32>) -> Result<()> {
        self.current()?;
        self.dequant(q, acc, true)
    }

    fn dequant(&self, q: &GpuQuantized, out: &mut DeviceSlice<f32>, add: bool) -> Result<()> {
        if out.len() != q.len {
            return Err(QuantError::LengthMismatch {
                what: "dequantize output",
                expected: q.len,
                actual: out.len(),
            });
        }
        if q.len == 0 {
            return Ok(());
        }
        // SAFETY: `q` is a live encoding on this context and `out` holds `q.len`
        // live f32 (checked above).
        unsafe { self.dequantize_at(q.at(), out.as_device_ptr().as_raw(), add)? };
        self.stream.synchronize()?;
        Ok(())
    }
}

/// An element-wise kernel of [`Gpu::elementwise_at`] (zeropp-comm's device
/// collectives): device addresses and a length in elements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Elementwise {
    /// `acc[i] += src[i]` over `n` f32.
    AddF32 {
        /// `n` f32.
        src: u64,
        /// `n` f32, in place.
        acc: u64,
    },
    /// `acc[i] += f32(src[i])` over `n` bf16 addends.
    AddBf16 {
        /// `n` bf16.
        src: u64,
        /// `n` f32, in place.
        acc: u64,
    },
    /// `x[i] /= by` over `n` f32.
    DivF32 {
        /// `n` f32, in place.
        x: u64,
        /// Divisor.
        by: f32,
    },
    /// qgZ error feedback: `res[i] = beta·res[i] + (1 − beta)·(comp[i] − deq[i])`
    /// over `n` f32, in Rust's evaluation order.
    Feedback {
        /// `n` f32: what was quantized.
        comp: u64,
        /// `n` f32: its dequantized value.
        deq: u64,
        /// `n` f32 residual, in place.
        res: u64,
        /// The moving-average factor.
        beta: f32,
    },
    /// `out[i] = bf16(src[i])`, nearest even (as `half::bf16::from_f32`).
    ToBf16 {
        /// `n` f32.
        src: u64,
        /// `n` bf16.
        out: u64,
    },
}

/// Calls on caller-managed device memory, by address (the `*_at` family), for
/// callers that keep many vectors and encodings in one allocation and order
/// work with events on [`Gpu::stream`]: zeropp-comm's device collectives. Each
/// `Gpu` has its own stream, so one `Gpu` per rank thread gives each rank its
/// own stream on the device's primary context.
impl Gpu {
    /// Enqueues the copy of `header` (`out`'s wire header: 32 bytes of metadata,
    /// not payload) on the stream; `header` must live until the stream is
    /// synchronized (the quantizing calls do before returning).
    fn write_header_at(&self, out: WireAt, header: &mut [u8; wire::HEADER_LEN]) -> Result<()> {
        wire::write_header(header, &out.spec, out.len)?;
        // SAFETY: `out.addr` starts a live region of at least HEADER_LEN bytes (the
        // callers' contract); the slice does not own it; `header` outlives the
        // copy: CUDA stages a copy from pageable memory before the call returns,
        // and the callers synchronize the stream before returning anyway.
        unsafe {
            let mut dst =
                DeviceSlice::from_raw_parts_mut(DevicePointer::<u8>::from_raw(out.addr), header.len());
            dst.async_copy_from(&header[..], &self.stream)?;
        }
        Ok(())
    }

    /// [`Gpu::quantize_into`] on addresses: quantizes the `out.len` values of `T`
    /// at `src` into the encoding `out` (header written too). Synchronizes the
    /// stream (the non-finite check reads one flag back). With INT4 and an odd
    /// group size the data region must be 4-byte aligned, else
    /// `QuantError::Cuda(InvalidValue)`.
    ///
    /// # Safety
    ///
    /// `src` must address `out.len` live values of `T` and `out.addr`
    /// `encoded_len(out.spec, out.len)` live bytes, both on this context, with no
    /// other work writing them meanwhile.
    pub unsafe fn quantize_at<T: GpuElement>(&self, src: u64, opts: &Options, out: WireAt) -> Result<()> {
        self.current()?;
        let mut header = [0u8; wire::HEADER_LEN];
        self.write_header_at(out, &mut header)?;
        // SAFETY: this function's contract.
        unsafe { self.launch_quantize::<T>(src, opts, out) }
    }

    /// [`Gpu::dequant_reduce_quant_into`] on addresses (header written too);
    /// synchronizes the stream.
    ///
    /// # Safety
    ///
    /// Every input and `out` must address live encodings of their specs and
    /// lengths on this context (all lengths equal `out.len`).
    pub unsafe fn dequant_reduce_quant_at(
        &self,
        inputs: &[WireAt],
        opts: &Options,
        out: WireAt,
    ) -> Result<()> {
        if inputs.is_empty() {
            return Err(QuantError::NoInputs);
        }
        if let Some(bad) = inputs.iter().find(|q| q.len != out.len) {
            return Err(QuantError::LengthMismatch {
                what: "dequant_reduce_quant_at input",
                expected: out.len,
                actual: bad.len,
            });
        }
        self.current()?;
        let mut header = [0u8; wire::HEADER_LEN];
        self.write_header_at(out, &mut header)?;
        // SAFETY: this function's contract.
        unsafe { self.launch_reduce_quantize(inputs, opts, out) }
    }

    /// Dequantizes the encoding `q` into the `q.len` f32 at `out` (or adds to
    /// them), enqueued on the stream without waiting.
    ///
    /// # Safety
    ///
    /// `q` must address a live encoding and `out` `q.len` live f32 on this context.
    pub unsafe fn dequantize_at(&self, q: WireAt, out: u64, add: bool) -> Result<()> {
        if q.len == 0 {
            return Ok(());
        }
        self.current()?;
        let d = desc_at(q.addr, &q.spec, q.len);
        let grid = q.spec.num_groups(q.len).min(MAX_BLOCKS) as u32;
        let (len, add) = (q.len as u64, u32::from(add));
        let f = self.module.get_function("zq_dequant")?;
        let stream = &self.stream;
        // SAFETY: the arguments match `zq_dequant`'s parameters; the addresses are
        // live by this function's contract.
        unsafe {
            launch!(f<<<grid, BLOCK, 0, stream>>>(d.data, d.scales, d.offsets, d.group_size, d.bits, len, out, add))?;
        }
        Ok(())
    }

    /// Runs an element-wise kernel over `n` elements, enqueued on the stream
    /// without waiting.
    ///
    /// # Safety
    ///
    /// Every address in `op` must point to `n` live elements of its type on
    /// this context.
    pub unsafe fn elementwise_at(&self, op: Elementwise, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.current()?;
        let grid = n.div_ceil(BLOCK as usize).min(MAX_BLOCKS) as u32;
        let stream = &self.stream;
        let n = n as u64;
        // SAFETY: (every arm) the arguments match the kernel's parameters in
        // order and type; the addresses are live by this function's contract.
        unsafe {
            match op {
                Elementwise::AddF32 { src, acc } => {
                    let f = self.module.get_function("zq_add_f32")?;
                    launch!(f<<<grid, BLOCK, 0, stream>>>(src, n, acc))?;
                }
                Elementwise::AddBf16 { src, acc } => {
                    let f = self.module.get_function("zq_add_bf16")?;
                    launch!(f<<<grid, BLOCK, 0, stream>>>(src, n, acc))?;
                }
                Elementwise::DivF32 { x, by } => {
                    let f = self.module.get_function("zq_div_f32")?;
                    launch!(f<<<grid, BLOCK, 0, stream>>>(x, n, by))?;
                }
                Elementwise::Feedback { comp, deq, res, beta } => {
                    let f = self.module.get_function("zq_feedback")?;
                    let k = 1.0f32 - beta;
                    launch!(f<<<grid, BLOCK, 0, stream>>>(comp, deq, res, n, beta, k))?;
                }
                Elementwise::ToBf16 { src, out } => {
                    let f = self.module.get_function("zq_to_bf16")?;
                    launch!(f<<<grid, BLOCK, 0, stream>>>(src, n, out))?;
                }
            }
        }
        Ok(())
    }
}

/// The shared arguments of the quantize kernels (`QuantArgs` in the `.cu` file).
struct QuantLaunch {
    grid: u32,
    len: u64,
    gs: u32,
    bits: u32,
    asym: u32,
    stochastic: u32,
    seed: u64,
    atomic_pack: u32,
    scales: u64,
    offsets: u64,
    data: u64,
    bad: u64,
}
