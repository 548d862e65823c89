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
use crate::hadamard::Hadamard;
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
}

mod addressed;
mod elementwise;
mod kernels;
mod memory;

pub use elementwise::Elementwise;
