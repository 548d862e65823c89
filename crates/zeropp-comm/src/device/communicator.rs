//! [`DeviceCommunicator`]: the [`Communicator`](crate::Communicator) primitives on
//! device buffers, with the same checks (`check.rs`) and the same traffic counters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{Device, View};
use crate::communicator::{call_shape, record_of};
use crate::{CommError, Group, Primitive, Topology, TrafficCounter, check};

/// One validated primitive call, handed to [`DeviceCommunicator::raw`].
#[derive(Debug)]
#[non_exhaustive]
pub enum DeviceCall<'a, D: Device> {
    /// `recv.len() == send.len() · g`.
    AllGather {
        /// This member's bytes.
        send: View<'a, D>,
        /// Every member's bytes, in group order.
        recv: View<'a, D>,
    },
    /// Both `chunk · g` bytes.
    AllToAll {
        /// Chunk `i` goes to member `i`.
        send: View<'a, D>,
        /// Chunk `j` comes from member `j`.
        recv: View<'a, D>,
    },
    /// Counts checked as for `all_to_all_v_bytes`.
    AllToAllV {
        /// Consecutive chunks, one per member.
        send: View<'a, D>,
        /// Bytes to each member.
        send_counts: &'a [usize],
        /// Consecutive chunks, one per member.
        recv: View<'a, D>,
        /// Bytes from each member.
        recv_counts: &'a [usize],
    },
    /// f32 sum-reduce-scatter: `send` holds `g` chunks of `recv.len()` bytes.
    ReduceScatterF32 {
        /// Full f32 vector.
        send: View<'a, D>,
        /// This member's summed chunk.
        recv: View<'a, D>,
    },
    /// f32 sum in place.
    AllReduceF32 {
        /// The vector.
        buf: View<'a, D>,
    },
    /// Copy from the member at group index `root`.
    Broadcast {
        /// Root's group index (valid).
        root: usize,
        /// The bytes.
        buf: View<'a, D>,
    },
    /// No data.
    Barrier,
}

impl<D: Device> Clone for DeviceCall<'_, D> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<D: Device> Copy for DeviceCall<'_, D> {}

impl<D: Device> DeviceCall<'_, D> {
    /// The primitive this call is.
    pub fn primitive(&self) -> Primitive {
        self.shape().0
    }

    /// The primitive and the lengths in bytes, as the host's [`RawCall`](crate::RawCall).
    fn shape(&self) -> (Primitive, check::Shape<'_>) {
        call_shape!(self, DeviceCall, ReduceScatterF32, AllReduceF32)
    }
}

/// Whole f32 elements in a window of `bytes`, or [`CommError::Mismatch`].
fn floats(p: Primitive, bytes: usize) -> Result<usize, CommError> {
    if !bytes.is_multiple_of(4) {
        return Err(CommError::Mismatch(format!(
            "{p}: a device window of {bytes} bytes is not whole f32 values"
        )));
    }
    Ok(bytes / 4)
}

/// Accumulated time of quantization kernels (quantize, dequantize, fused
/// dequantize-sum-requantize), each timed to completion; see
/// [`DeviceCommunicator::quant_timer`]. Shared by reference count between ranks.
#[derive(Debug, Default)]
pub struct QuantTimer(AtomicU64);

impl QuantTimer {
    /// A timer at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `d`.
    pub fn add(&self, d: Duration) {
        self.0.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// The total so far.
    pub fn total(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
    }

    /// Back to zero.
    pub fn reset(&self) {
        self.0.store(0, Ordering::Relaxed);
    }
}

/// A rank's handle on a job whose buffers live on a device: the
/// [`Communicator`](crate::Communicator) primitives on [`View`]s of device buffers,
/// enqueued on [`DeviceCommunicator::stream`] (the results are ready for later work
/// on that stream; download or synchronize to see them on the host).
///
/// The provided methods check arguments exactly as the host trait does (same
/// [`CommError`] variants and messages, from the shared `check` module; f32
/// primitives also need windows of whole floats) and count the same traffic
/// through the same function as the host trait (the table in [`crate::threads`]); a backend implements
/// [`DeviceCommunicator::raw`] only.
///
/// ```
/// use zeropp_comm::device::{DeviceBuf, DeviceCluster, DeviceCommunicator, HostDevice};
/// use zeropp_comm::{Group, ThreadOptions, Topology};
/// let cluster = DeviceCluster::new(Topology::ranks(2).per_node(2)?, HostDevice, ThreadOptions::default());
/// let out = cluster.run(|comm| {
///     let (dev, world) = (comm.device().clone(), Group::world(comm.topology()));
///     let send = DeviceBuf::from_bytes(&dev, comm.stream(), &[comm.rank() as u8; 2])?;
///     let recv = DeviceBuf::zeroed(&dev, 4)?;
///     comm.all_gather(&world, send.view(), recv.view())?;
///     recv.to_bytes(&dev, comm.stream())
/// })?;
/// assert_eq!(out[1], [0, 0, 1, 1]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait DeviceCommunicator: Send {
    /// The device the buffers live on.
    type Device: Device;

    /// This rank's global rank.
    fn rank(&self) -> usize;
    /// The job's topology.
    fn topology(&self) -> &Topology;
    /// The traffic counters.
    fn traffic(&self) -> &TrafficCounter;
    /// Mutable traffic counters (operation tag, reset).
    fn traffic_mut(&mut self) -> &mut TrafficCounter;
    /// The device.
    fn device(&self) -> &Self::Device;
    /// This rank's stream: collectives are ordered on it.
    fn stream(&self) -> &<Self::Device as Device>::Stream;

    /// The quantization-kernel timer, when one is set (benches): the device
    /// collectives then synchronize around each quantization kernel and add its
    /// time to it. `None` by default.
    fn quant_timer(&self) -> Option<&QuantTimer> {
        None
    }

    /// Backend hook: runs a call whose arguments were checked (the caller is member
    /// `index` of `group`). Counts no traffic.
    fn raw(
        &mut self,
        group: &Group,
        index: usize,
        call: DeviceCall<'_, Self::Device>,
    ) -> Result<(), CommError>;

    /// Collective over the world: an independent communicator on the same ranks,
    /// with its own stream.
    fn duplicate(&mut self) -> Result<Self, CommError>
    where
        Self: Sized;

    /// Checks `call` (membership, then its arguments), runs it, counts it.
    fn call(&mut self, group: &Group, call: DeviceCall<'_, Self::Device>) -> Result<(), CommError> {
        let (p, mut shape) = call.shape();
        let me = check::member(self.topology(), self.rank(), group, p)?;
        if matches!(p, Primitive::ReduceScatter | Primitive::AllReduce) {
            // The f32 primitives check lengths in elements, as on the host, and
            // views aligned to whole f32 (a GPU faults on a misaligned float).
            shape.send = floats(p, shape.send)?;
            shape.recv = floats(p, shape.recv)?;
            match call {
                DeviceCall::ReduceScatterF32 { send, recv } => {
                    super::check_aligned(send, 4, &format!("{p} send"))?;
                    super::check_aligned(recv, 4, &format!("{p} receive"))?;
                }
                DeviceCall::AllReduceF32 { buf } => super::check_aligned(buf, 4, &format!("{p} buffer"))?,
                _ => {}
            }
        }
        check::arguments_of(group, me, p, &shape)?;
        self.raw(group, me, call)?;
        record_of(self.traffic_mut(), group, me, p, &shape);
        Ok(())
    }

    /// All-gather: `recv.len() == send.len() · g`, chunk `i` from member `i`.
    fn all_gather(
        &mut self,
        group: &Group,
        send: View<'_, Self::Device>,
        recv: View<'_, Self::Device>,
    ) -> Result<(), CommError> {
        self.call(group, DeviceCall::AllGather { send, recv })
    }

    /// Equal-chunk all-to-all.
    fn all_to_all(
        &mut self,
        group: &Group,
        send: View<'_, Self::Device>,
        recv: View<'_, Self::Device>,
    ) -> Result<(), CommError> {
        self.call(group, DeviceCall::AllToAll { send, recv })
    }

    /// Variable-chunk all-to-all.
    fn all_to_all_v(
        &mut self,
        group: &Group,
        send: View<'_, Self::Device>,
        send_counts: &[usize],
        recv: View<'_, Self::Device>,
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        self.call(group, DeviceCall::AllToAllV { send, send_counts, recv, recv_counts })
    }

    /// f32 sum-reduce-scatter, summed in group order from zero.
    fn reduce_scatter_f32(
        &mut self,
        group: &Group,
        send: View<'_, Self::Device>,
        recv: View<'_, Self::Device>,
    ) -> Result<(), CommError> {
        self.call(group, DeviceCall::ReduceScatterF32 { send, recv })
    }

    /// f32 sum in place, in group order from zero.
    fn all_reduce_f32(&mut self, group: &Group, buf: View<'_, Self::Device>) -> Result<(), CommError> {
        self.call(group, DeviceCall::AllReduceF32 { buf })
    }

    /// Copies the root member's `buf` into every member's `buf`.
    fn broadcast(
        &mut self,
        group: &Group,
        root: usize,
        buf: View<'_, Self::Device>,
    ) -> Result<(), CommError> {
        self.call(group, DeviceCall::Broadcast { root, buf })
    }

    /// Returns once every member has entered (and the stream's earlier work of
    /// every member is ordered before the members' later work).
    fn barrier(&mut self, group: &Group) -> Result<(), CommError> {
        self.call(group, DeviceCall::Barrier)
    }
}
