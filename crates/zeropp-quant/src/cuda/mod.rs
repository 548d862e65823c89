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
//! Every call is synchronous and uses device 0. A [`Gpu`] makes its context
//! current on the calling thread at each call; drop device buffers before the
//! [`Gpu`] that made them.
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

/// A vector of `T` in device memory (input of [`Gpu::quantize`]).
#[derive(Debug)]
pub struct GpuVec<T: GpuElement> {
    buf: DeviceBuffer<T::Raw>,
    _t: PhantomData<T>,
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
    /// [`Gpu::dequantize_add`]).
    pub fn into_buffer(self) -> DeviceBuffer<T::Raw> {
        self.buf
    }
}

/// A quantized vector in device memory, in the [wire layout](crate::wire):
/// header, scales, offsets (asymmetric), packed data.
#[derive(Debug)]
pub struct GpuQuantized {
    spec: QuantSpec,
    len: usize,
    buf: DeviceBuffer<u8>,
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

    /// Size of the wire encoding (the device buffer's size).
    pub fn encoded_len(&self) -> usize {
        self.buf.len()
    }

    /// The device buffer holding the wire encoding (what a GPU rank sends).
    pub fn buffer(&self) -> &DeviceBuffer<u8> {
        &self.buf
    }

    /// The encoding by address, for the `*_at` calls of [`Gpu`].
    pub fn at(&self) -> WireAt {
        WireAt { addr: self.buf.as_device_ptr().as_raw(), spec: self.spec, len: self.len }
    }

    /// Copies the wire encoding to the host.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.buf.len()];
        self.buf.copy_to(&mut v[..])?;
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

/// The GPU (device 0) with the kernels loaded.
///
/// [`Gpu::new`] fails with [`QuantError::Cuda`] when there is no driver or no
/// device (the stub `libcuda.so.1` that `cargo xtask` builds for linking
/// answers `NoDevice`).
#[derive(Debug)]
pub struct Gpu {
    // Declaration order is drop order: the module and stream before the context.
    module: Module,
    stream: Stream,
    device: Device,
    image: &'static str,
    /// The quantize kernels' first non-finite index (one u64, reused).
    bad: DeviceBuffer<u64>,
    ctx: Context,
}

impl Gpu {
    /// Initialises CUDA, retains device 0's primary context and loads the
    /// kernels: the cubin for the device's architecture, else the PTX.
    pub fn new() -> Result<Self> {
        cust::init(cust::CudaFlags::empty())?;
        let device = Device::get_device(0)?;
        let ctx = Context::new(device)?;
        let major = device.get_attribute(DeviceAttribute::ComputeCapabilityMajor)?;
        let cubin = match major {
            8 => Some(("sm_80 cubin", SM80)),
            9 => Some(("sm_90 cubin", SM90)),
            _ => None,
        };
        let loaded = cubin.and_then(|(name, bytes)| Module::from_cubin(bytes, &[]).ok().map(|m| (name, m)));
        let (image, module) = match loaded {
            Some(x) => x,
            None => ("PTX (JIT-compiled by the driver)", Module::from_ptx(PTX, &[])?),
        };
        let stream = Stream::new(StreamFlags::DEFAULT, None)?;
        let bad = DeviceBuffer::from_slice(&[u64::MAX])?;
        Ok(Self { module, stream, device, image, bad, ctx })
    }

    /// The device's name.
    pub fn device_name(&self) -> Result<String> {
        Ok(self.device.name()?)
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

    fn current(&self) -> Result<()> {
        CurrentContext::set_current(&self.ctx)?;
        Ok(())
    }

    /// Makes this GPU's (primary) context current on the calling thread, for
    /// callers that allocate or copy through `cust` directly.
    pub fn make_current(&self) -> Result<()> {
        self.current()
    }

    /// Copies `x` to the device.
    pub fn upload<T: GpuElement>(&self, x: &[T]) -> Result<GpuVec<T>> {
        self.current()?;
        let raw: Vec<T::Raw> = x.iter().map(|&v| v.raw()).collect();
        Ok(GpuVec { buf: DeviceBuffer::from_slice(&raw)?, _t: PhantomData })
    }

    /// Copies a device f32 buffer to the host.
    pub fn download(&self, x: &DeviceSlice<f32>) -> Result<Vec<f32>> {
        self.current()?;
        let mut v = vec![0f32; x.len()];
        x.copy_to(&mut v[..])?;
        Ok(v)
    }

    /// Copies a quantized value (owned or a view of received wire bytes) to the device.
    pub fn upload_quantized<Q: AsQuantizedRef + ?Sized>(&self, q: &Q) -> Result<GpuQuantized> {
        let q = q.as_quantized_ref();
        self.current()?;
        let buf = DeviceBuffer::from_slice(&q.to_bytes())?;
        Ok(GpuQuantized { spec: q.spec(), len: q.len(), buf })
    }

    /// Checks wire bytes (every check of [`QuantizedRef::from_bytes`]) and copies them to the device.
    pub fn upload_wire(&self, bytes: &[u8]) -> Result<GpuQuantized> {
        let q = QuantizedRef::from_bytes(bytes)?;
        self.current()?;
        Ok(GpuQuantized { spec: q.spec(), len: q.len(), buf: DeviceBuffer::from_slice(bytes)? })
    }

    /// A device buffer of `len` f32 zeros (a destination for dequantization).
    pub fn zeros(&self, len: usize) -> Result<DeviceBuffer<f32>> {
        self.current()?;
        Ok(DeviceBuffer::zeroed(len)?)
    }

    /// A quantized destination of `len` elements in `spec` on the device: the
    /// header is written, the rest is zero (not a valid value until a
    /// `*_into` call fills it). For [`Gpu::quantize_into`] and
    /// [`Gpu::dequant_reduce_quant_into`], which reuse it without allocating.
    pub fn quantized_buffer(&self, spec: QuantSpec, len: usize) -> Result<GpuQuantized> {
        self.current()?;
        let total = wire::checked_encoded_len(&spec, len).ok_or(QuantError::TooLarge(len as u64))?;
        let mut header = [0u8; wire::HEADER_LEN];
        wire::write_header(&mut header, &spec, len)?;
        let buf = DeviceBuffer::<u8>::zeroed(total)?;
        buf.index(..wire::HEADER_LEN).copy_from(&header[..])?;
        Ok(GpuQuantized { spec, len, buf })
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
        let descs: Vec<InDesc> = inputs.iter().map(|q| desc_at(q.addr, &q.spec, q.len)).collect();
        let descs = DeviceBuffer::from_slice(&descs)?;
        let (din, k) = (descs.as_device_ptr().as_raw(), inputs.len() as u32);
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
            // does not own it (dropping it frees nothing).
            let mut data = unsafe {
                DeviceSlice::from_raw_parts_mut(DevicePointer::<u8>::from_raw(d.data), out.len.div_ceil(2))
            };
            data.set_zero()?;
        }
        // All ones = u64::MAX: no non-finite element seen yet.
        self.bad.index(..).set_8(0xFF)?;
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
        self.stream.synchronize()?;
        let mut first = [0u64];
        self.bad.copy_to(&mut first[..])?;
        let first_bad = first[0];
        if first_bad != u64::MAX {
            let value = value_at(first_bad)?;
            return Err(QuantError::NonFinite { index: first_bad as usize, value });
        }
        Ok(())
    }

    /// Element `i` of a quantize source as f32 (`k` inputs for the fused kernel).
    fn value(&self, kernel: &str, src: u64, k: Option<u32>, i: u64) -> Result<f32> {
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

    /// Dequantizes into a new device buffer, like [`crate::dequantize`].
    pub fn dequantize(&self, q: &GpuQuantized) -> Result<DeviceBuffer<f32>> {
        self.current()?;
        // SAFETY: f32 has no invalid bit patterns and the kernel writes every element.
        let mut out = unsafe { DeviceBuffer::uninitialized(q.len)? };
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
