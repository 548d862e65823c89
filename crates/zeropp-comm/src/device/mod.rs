//! Device-resident collectives: the communicator design on device buffers.
//!
//! [`Communicator`](crate::Communicator) moves host bytes. ZeRO++ runs on GPUs, so
//! this module adds a **sibling trait**, [`DeviceCommunicator`], with the same
//! collective set (all-gather, all-to-all(v), reduce-scatter, all-reduce,
//! broadcast, barrier, duplicate) on [`DeviceBuf`] views, ordered on the rank's
//! stream. Its provided methods validate with the same checks as the host trait
//! (`check.rs`: same [`CommError`] variants and words) and count the same traffic
//! into a [`TrafficCounter`](crate::TrafficCounter) (same counters), then call one
//! backend hook, [`DeviceCommunicator::raw`].
//!
//! # Layers
//!
//! - [`Device`]: the few operations a device provides: allocate, copy
//!   (host↔device, device↔device), events on streams, and the [`Kernel`]s the
//!   ZeRO++ collectives need (quantize, dequantize(-add), the fused qgZ
//!   dequantize-sum-requantize, f32 add/divide, bf16 conversions).
//!   [`HostDevice`] implements it in host memory with the CPU kernels of
//!   `zeropp-quant` (bit-identical to the CUDA kernels), so everything above it runs
//!   and is tested without a GPU. `CudaDevice` (feature `cuda`) implements it with
//!   `cust` on one NVIDIA GPU: that thin layer is the only part only a GPU runs.
//! - [`DeviceCluster`] / [`DeviceComm`]: the one-device simulated cluster, the
//!   device analog of [`ThreadCluster`](crate::ThreadCluster): one host thread per
//!   rank, each with its own stream; a collective is a rendezvous where every member
//!   posts its buffers with a *ready* event, peers wait on that event on their own
//!   stream and copy device-to-device (or run the reduction kernel) straight from the
//!   poster's buffer, then post a *done* event the poster's stream waits on before it
//!   may reuse the buffer. The optional [`LinkModel`](crate::LinkModel) delays
//!   delivery as in the thread backend. `DeviceComm` also implements the host
//!   [`Communicator`](crate::Communicator) (staging through device buffers), so the
//!   conformance suite runs on it unchanged.
//! - [`collectives`]: qwZ all-gather, hpZ gathers, the qgZ two-hop reduce-scatter
//!   (fused kernel; LoCo, two-level specs and the Hadamard rotation, by the host
//!   stages' own schedule), the world gathers and reduce-scatters with flat or
//!   hierarchical routing, and the bf16 baselines, written once on
//!   [`DeviceCommunicator`], with no host round trip of the payload. On
//!   [`HostDevice`] their results are bitwise equal to the host collectives on the
//!   thread backend (tests); qwZ-Δ's encode, apply and exchange likewise.
//! - `NcclComm` (feature `nccl`): the same trait on NCCL, loaded at run time,
//!   bootstrapped over any host communicator (MPI under `mpirun`).

/// The [`DeviceCommunicator`] getters of a backend struct with the fields
/// `rank`, `topology`, `traffic`, `device` and `stream` (inside its `impl`).
macro_rules! device_getters {
    () => {
        fn rank(&self) -> usize {
            self.rank
        }

        fn topology(&self) -> &$crate::Topology {
            &self.topology
        }

        fn traffic(&self) -> &$crate::TrafficCounter {
            &self.traffic
        }

        fn traffic_mut(&mut self) -> &mut $crate::TrafficCounter {
            &mut self.traffic
        }

        fn device(&self) -> &Self::Device {
            &self.device
        }

        fn stream(&self) -> &<Self::Device as $crate::device::Device>::Stream {
            &self.stream
        }
    };
}

pub mod collectives;
mod communicator;
#[cfg(feature = "cuda")]
mod cuda;
mod host;
#[cfg(feature = "nccl")]
mod nccl;
mod rendezvous;
mod sim;
mod staged;

use std::fmt;
use std::sync::Arc;

pub use communicator::{DeviceCall, DeviceCommunicator, QuantTimer};
#[cfg(feature = "cuda")]
pub use cuda::{CudaDevice, CudaEvent, CudaMem, CudaStream};
pub use host::{HostDevice, HostEvent, HostMem, HostStream};
#[cfg(feature = "nccl")]
pub use nccl::NcclComm;
pub use sim::{DeviceCluster, DeviceComm};

use crate::CommError;
use crate::quant::{Options, QuantSpec};

/// The element type of a device vector a kernel reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    /// IEEE f32 (4 bytes).
    F32,
    /// bfloat16 (2 bytes).
    Bf16,
}

impl Elem {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::Bf16 => 2,
        }
    }
}

/// One compute operation on device memory, run in order on a stream by
/// [`Device::kernel`]. Lengths are in elements; views are byte windows.
#[derive(Debug)]
#[non_exhaustive]
pub enum Kernel<'a, D: Device> {
    /// Quantizes `len` elements of `src` (type `elem`) into the wire encoding at
    /// `dst` (exactly `encoded_len(spec, len)` bytes), like
    /// `zeropp_quant::quantize_to_wire`.
    Quantize {
        /// Input vector.
        src: View<'a, D>,
        /// Its element type.
        elem: Elem,
        /// Output format.
        spec: QuantSpec,
        /// Rounding (only `rounding` is read on a GPU).
        opts: Options,
        /// Output wire bytes.
        dst: View<'a, D>,
    },
    /// Dequantizes the wire encoding `src` (`len` elements in `spec`) into the f32
    /// vector `dst`, or adds it to `dst` (`add`), like `dequantize_into` /
    /// `dequantize_add`.
    Dequantize {
        /// Wire bytes.
        src: View<'a, D>,
        /// Their format.
        spec: QuantSpec,
        /// Elements.
        len: usize,
        /// f32 output.
        dst: View<'a, D>,
        /// Accumulate instead of overwrite.
        add: bool,
    },
    /// The fused qgZ kernel: dequantizes `inputs` (wire encodings of `len`
    /// elements each, in their specs), sums them in f32 in input order, and
    /// requantizes with `spec` into `dst`, like `dequant_reduce_quant_to_wire`.
    DequantReduceQuant {
        /// The encodings and their specs.
        inputs: &'a [(View<'a, D>, QuantSpec)],
        /// Elements of each input and of the output.
        len: usize,
        /// Output format.
        spec: QuantSpec,
        /// Rounding.
        opts: Options,
        /// Output wire bytes.
        dst: View<'a, D>,
    },
    /// `dst[i] += src[i]` over f32 (`src` of element type `elem`, converted to
    /// f32 exactly first).
    Add {
        /// Addend.
        src: View<'a, D>,
        /// Its element type.
        elem: Elem,
        /// f32 accumulator.
        dst: View<'a, D>,
    },
    /// `x[i] /= by` over f32 (correctly rounded division, as the host's mean).
    Div {
        /// f32 vector, in place.
        buf: View<'a, D>,
        /// The divisor.
        by: f32,
    },
    /// qgZ error feedback on f32 vectors of equal length:
    /// `res[i] = beta·res[i] + (1 − beta)·(comp[i] − deq[i])`, evaluated as the
    /// host's `ErrorFeedback` does.
    Feedback {
        /// What was quantized.
        comp: View<'a, D>,
        /// Its dequantized value.
        deq: View<'a, D>,
        /// The residual, in place.
        res: View<'a, D>,
        /// The moving-average factor β.
        beta: f32,
    },
    /// The randomized Hadamard rotation of every whole group of the f32 vector
    /// `buf`, in place (`buf`'s first element at stream position `position`;
    /// forward, or back when `inverse`), like `Hadamard::forward` /
    /// `Hadamard::inverse`. A partial last group is left as it is.
    Hadamard {
        /// f32 vector, in place.
        buf: View<'a, D>,
        /// The rotation (group size and sign seed).
        h: zeropp_quant::Hadamard,
        /// Stream position of `buf`'s first element.
        position: u64,
        /// Rotate back instead of forward.
        inverse: bool,
    },
    /// `dst[i] = f32(src[i])` from bf16, exactly (`half::bf16::to_f32`).
    FromBf16 {
        /// bf16 input.
        src: View<'a, D>,
        /// f32 output.
        dst: View<'a, D>,
    },
    /// `dst[i] = bf16(src[i])`, rounded to nearest even (`half::bf16::from_f32`).
    ToBf16 {
        /// f32 input.
        src: View<'a, D>,
        /// bf16 output.
        dst: View<'a, D>,
    },
}

/// Checks that `v` starts at a multiple of `elem` bytes inside its allocation
/// (allocations themselves are at least 256-byte aligned on a GPU), else a
/// [`CommError::Mismatch`] naming `what` and the offset.
pub(crate) fn check_aligned<D: Device>(v: View<'_, D>, elem: usize, what: &str) -> Result<(), CommError> {
    if v.offset().is_multiple_of(elem) {
        Ok(())
    } else {
        Err(CommError::Mismatch(format!(
            "{what}: device window at byte offset {} is not aligned to its {elem}-byte elements",
            v.offset()
        )))
    }
}

impl<D: Device> Kernel<'_, D> {
    /// Checks that every f32 (bf16) view of the kernel starts at a multiple of
    /// 4 (2) bytes, the one alignment check every [`Device`] runs before a
    /// kernel, so a misaligned view fails alike in host memory and on a GPU
    /// (where it would raise `CUDA_ERROR_MISALIGNED_ADDRESS`, an error that
    /// poisons the context of every rank in the process). Wire encodings have
    /// no alignment requirement: a device realigns them itself.
    pub fn check_alignment(&self) -> Result<(), CommError> {
        let f32s = |v: View<'_, D>, what: &str| check_aligned(v, 4, what);
        match *self {
            Kernel::Quantize { src, elem, .. } => check_aligned(src, elem.size(), "quantize input"),
            Kernel::Dequantize { dst, .. } => f32s(dst, "dequantize output"),
            Kernel::DequantReduceQuant { .. } => Ok(()),
            Kernel::Add { src, elem, dst } => {
                check_aligned(src, elem.size(), "add input")?;
                f32s(dst, "add accumulator")
            }
            Kernel::Div { buf, .. } => f32s(buf, "divide"),
            Kernel::Hadamard { buf, .. } => f32s(buf, "hadamard"),
            Kernel::Feedback { comp, deq, res, .. } => {
                f32s(comp, "feedback")?;
                f32s(deq, "feedback")?;
                f32s(res, "feedback")
            }
            Kernel::FromBf16 { src, dst } => {
                check_aligned(src, 2, "from_bf16 input")?;
                f32s(dst, "from_bf16 output")
            }
            Kernel::ToBf16 { src, dst } => {
                f32s(src, "to_bf16 input")?;
                check_aligned(dst, 2, "to_bf16 output")
            }
        }
    }
}

/// A device: memory, streams, events and the [`Kernel`]s of the ZeRO++
/// collectives. Operations are enqueued on a stream and run in order on it;
/// [`Device::record`] / [`Device::wait`] order work across streams.
///
/// Device memory ([`Device::Mem`]) is written through shared references: it is
/// not Rust memory, and the collectives order writers and readers with events.
pub trait Device: Clone + Send + Sync + fmt::Debug + 'static {
    /// One allocation.
    type Mem: Send + Sync + fmt::Debug + 'static;
    /// An in-order work queue (one per rank).
    type Stream: Send + fmt::Debug + 'static;
    /// A point in a stream's work that other streams can wait for.
    type Event: Send + Sync + fmt::Debug + 'static;

    /// A short description (device name, or "host memory").
    fn name(&self) -> String;
    /// `bytes` zeroed bytes of device memory.
    fn alloc(&self, bytes: usize) -> Result<Self::Mem, CommError>;
    /// A new stream.
    fn stream(&self) -> Result<Self::Stream, CommError>;
    /// Copies `src` (host) into `dst` (`dst.len() == src.len()`), in stream order.
    fn upload(&self, stream: &Self::Stream, src: &[u8], dst: View<'_, Self>) -> Result<(), CommError>;
    /// Copies `src` into `dst` (host) once the stream's earlier work is done; returns
    /// after the copy.
    fn download(&self, stream: &Self::Stream, src: View<'_, Self>, dst: &mut [u8]) -> Result<(), CommError>;
    /// Device-to-device copy of `src` into `dst` (equal lengths, distinct or
    /// disjoint windows), in stream order.
    fn copy(&self, stream: &Self::Stream, src: View<'_, Self>, dst: View<'_, Self>) -> Result<(), CommError>;
    /// Zeroes `dst`, in stream order.
    fn zero(&self, stream: &Self::Stream, dst: View<'_, Self>) -> Result<(), CommError>;
    /// Runs a kernel, in stream order. Implementations start with
    /// [`Kernel::check_alignment`].
    fn kernel(&self, stream: &Self::Stream, kernel: Kernel<'_, Self>) -> Result<(), CommError>;
    /// Records an event after the stream's work so far.
    fn record(&self, stream: &Self::Stream) -> Result<Self::Event, CommError>;
    /// Makes the stream's later work wait for `event` (no host wait).
    fn wait(&self, stream: &Self::Stream, event: &Self::Event) -> Result<(), CommError>;
    /// Blocks the host until the stream's work is done.
    fn synchronize(&self, stream: &Self::Stream) -> Result<(), CommError>;
}

/// A device allocation of `len` bytes, shared by reference count (a collective
/// lends it to its peers for the duration of the call).
pub struct DeviceBuf<D: Device> {
    mem: Arc<D::Mem>,
    len: usize,
}

impl<D: Device> Clone for DeviceBuf<D> {
    fn clone(&self) -> Self {
        Self { mem: Arc::clone(&self.mem), len: self.len }
    }
}

impl<D: Device> fmt::Debug for DeviceBuf<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuf").field("len", &self.len).finish_non_exhaustive()
    }
}

impl<D: Device> DeviceBuf<D> {
    /// `bytes` zeroed bytes on `device`.
    pub fn zeroed(device: &D, bytes: usize) -> Result<Self, CommError> {
        Ok(Self { mem: Arc::new(device.alloc(bytes)?), len: bytes })
    }

    /// A buffer holding `bytes`, uploaded on `stream`.
    pub fn from_bytes(device: &D, stream: &D::Stream, bytes: &[u8]) -> Result<Self, CommError> {
        let b = Self::zeroed(device, bytes.len())?;
        device.upload(stream, bytes, b.view())?;
        Ok(b)
    }

    /// A buffer holding the f32 values `x` (`4·x.len()` bytes).
    pub fn from_f32(device: &D, stream: &D::Stream, x: &[f32]) -> Result<Self, CommError> {
        Self::from_bytes(device, stream, bytemuck::cast_slice(x))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The allocation.
    pub fn mem(&self) -> &D::Mem {
        &self.mem
    }

    /// The whole buffer.
    pub fn view(&self) -> View<'_, D> {
        View { buf: self, off: 0, len: self.len }
    }

    /// Bytes `[off, off + len)`, or [`CommError::Mismatch`] when outside.
    pub fn slice(&self, off: usize, len: usize) -> Result<View<'_, D>, CommError> {
        self.view().slice(off, len)
    }

    /// Downloads the whole buffer.
    pub fn to_bytes(&self, device: &D, stream: &D::Stream) -> Result<Vec<u8>, CommError> {
        let mut out = vec![0u8; self.len];
        device.download(stream, self.view(), &mut out)?;
        Ok(out)
    }

    /// Downloads the whole buffer as f32 values (whole floats only).
    pub fn to_f32(&self, device: &D, stream: &D::Stream) -> Result<Vec<f32>, CommError> {
        let bytes = self.to_bytes(device, stream)?;
        Ok(bytemuck::pod_collect_to_vec(bytes.get(..bytes.len() / 4 * 4).unwrap_or_default()))
    }
}

/// A byte window `[off, off + len)` of a [`DeviceBuf`].
pub struct View<'a, D: Device> {
    buf: &'a DeviceBuf<D>,
    off: usize,
    len: usize,
}

impl<D: Device> Clone for View<'_, D> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<D: Device> Copy for View<'_, D> {}

impl<D: Device> fmt::Debug for View<'_, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("View").field("off", &self.off).field("len", &self.len).finish()
    }
}

impl<'a, D: Device> View<'a, D> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the window is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Offset in the buffer, in bytes.
    pub fn offset(&self) -> usize {
        self.off
    }

    /// The buffer this window is part of.
    pub fn buf(&self) -> &'a DeviceBuf<D> {
        self.buf
    }

    /// The allocation.
    pub fn mem(&self) -> &'a D::Mem {
        &self.buf.mem
    }

    /// Bytes `[off, off + len)` of this window, or [`CommError::Mismatch`] when outside.
    pub fn slice(&self, off: usize, len: usize) -> Result<View<'a, D>, CommError> {
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(View { buf: self.buf, off: self.off + off, len }),
            _ => Err(CommError::Mismatch(format!(
                "device buffer: window of {len} bytes at offset {off} lies outside a window of {}",
                self.len
            ))),
        }
    }

    /// Chunk `index` of `len` bytes, checked.
    pub fn chunk(&self, index: usize, len: usize) -> Result<View<'a, D>, CommError> {
        let off = index.checked_mul(len).ok_or_else(|| {
            CommError::Mismatch(format!("device buffer: chunk {index} of {len} bytes overflows"))
        })?;
        self.slice(off, len)
    }

    /// Whether both windows lie in the same allocation and overlap.
    pub fn overlaps(&self, other: &View<'_, D>) -> bool {
        Arc::ptr_eq(&self.buf.mem, &other.buf.mem)
            && self.off < other.off + other.len
            && other.off < self.off + self.len
    }
}
