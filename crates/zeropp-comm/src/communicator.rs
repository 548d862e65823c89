//! The [`Communicator`] trait: the few group primitives every backend provides.
//!
//! The ZeRO++ collectives (`crate::collectives`) are written once on top of these
//! primitives. A backend never assumes that ranks share an address space: every
//! buffer is the caller's, every result is written into a caller buffer.
//!
//! # Checked front, raw backend
//!
//! Like wgpu's core over its hal, the trait is split in two layers. The primitives
//! callers use ([`Communicator::all_gather_bytes`], …) are *provided* methods: they
//! validate the group and the arguments once, for every backend (so every backend
//! reports the same [`CommError`] variant with the same words), hand the call to the
//! backend's [`Communicator::raw`] hook, and count the traffic once the hook succeeded (so every
//! backend counts the same bytes, see [`crate::threads`] for the table). A backend
//! implements only the hook, which may assume valid arguments, plus
//! [`Communicator::raw_reject`] when its peers must learn that a member rejected
//! its arguments (the MPI backend does, so no peer waits forever).

use crate::check::{self, Primitive};
use crate::{CommError, Group, Topology, TrafficCounter};

/// One primitive's arguments, as the checked methods of [`Communicator`] hand them
/// to the backend's [`Communicator::raw`] hook, already validated (the conditions
/// under each variant hold; the caller is member `index` of `group`).
///
/// ```
/// use zeropp_comm::{Primitive, RawCall};
/// let call = RawCall::Broadcast { root: 0, buf: &mut [0u8; 4] };
/// assert_eq!(call.primitive(), Primitive::Broadcast);
/// ```
#[derive(Debug)]
pub enum RawCall<'a> {
    /// [`Communicator::all_gather_bytes`]: `recv.len() == send.len() * group.size()`.
    AllGather {
        /// This member's chunk.
        send: &'a [u8],
        /// Every member's chunk, in group order.
        recv: &'a mut [u8],
    },
    /// [`Communicator::all_to_all_bytes`]: both buffers are `chunk * group.size()` bytes.
    AllToAll {
        /// Chunk `i` goes to member `i`.
        send: &'a [u8],
        /// Chunk `j` comes from member `j`.
        recv: &'a mut [u8],
    },
    /// [`Communicator::all_to_all_v_bytes`]: one count per member, the counts add
    /// up to the buffer lengths and `send_counts[index] == recv_counts[index]`.
    /// Whether a peer sends what the caller expects is the hook's to find out.
    AllToAllV {
        /// Consecutive chunks, one per member.
        send: &'a [u8],
        /// The length of each chunk of `send`.
        send_counts: &'a [usize],
        /// Consecutive chunks, one per member.
        recv: &'a mut [u8],
        /// The length of each chunk of `recv`.
        recv_counts: &'a [usize],
    },
    /// [`Communicator::reduce_scatter_f32`]: `send.len() == recv.len() * group.size()`.
    ReduceScatter {
        /// Chunk `i` is this member's part of member `i`'s sum.
        send: &'a [f32],
        /// This member's chunk of the sum.
        recv: &'a mut [f32],
    },
    /// [`Communicator::all_reduce_f32`].
    AllReduce {
        /// Summed in place.
        buf: &'a mut [f32],
    },
    /// [`Communicator::broadcast_bytes`]: `root` is a valid group index.
    Broadcast {
        /// The group index of the member whose `buf` is copied.
        root: usize,
        /// The root's data, or where it lands.
        buf: &'a mut [u8],
    },
    /// [`Communicator::barrier`].
    Barrier,
}

/// The primitive and the [`check::Shape`] (lengths, counts, root) of a call enum
/// whose variants are the seven primitives': the host [`RawCall`] and
/// `device::DeviceCall` both reduce to them here, so they are checked and counted
/// alike. `$rs` and `$ar` name the enum's reduce-scatter and all-reduce variants.
macro_rules! call_shape {
    ($call:expr, $E:ident, $rs:ident, $ar:ident) => {{
        use $crate::Primitive as P;
        use $crate::check::Shape;
        match $call {
            $E::AllGather { send, recv } => (P::AllGather, Shape::buffers(send.len(), recv.len())),
            $E::AllToAll { send, recv } => (P::AllToAll, Shape::buffers(send.len(), recv.len())),
            $E::AllToAllV { send, send_counts, recv, recv_counts } => {
                (P::AllToAllV, Shape { send_counts, recv_counts, ..Shape::buffers(send.len(), recv.len()) })
            }
            $E::$rs { send, recv } => (P::ReduceScatter, Shape::buffers(send.len(), recv.len())),
            $E::$ar { buf } => (P::AllReduce, Shape::buffers(buf.len(), 0)),
            $E::Broadcast { root, buf } => {
                (P::Broadcast, Shape { root: *root, ..Shape::buffers(buf.len(), 0) })
            }
            $E::Barrier => (P::Barrier, Shape::buffers(0, 0)),
        }
    }};
}
pub(crate) use call_shape;

impl RawCall<'_> {
    /// The primitive these are the arguments of.
    pub fn primitive(&self) -> Primitive {
        self.shape().0
    }

    /// The primitive and the lengths (bytes; elements for the f32 primitives).
    pub(crate) fn shape(&self) -> (Primitive, check::Shape<'_>) {
        call_shape!(self, RawCall, ReduceScatter, AllReduce)
    }

    /// The same call on reborrowed buffers (to keep the lengths after the hook).
    fn reborrow(&mut self) -> RawCall<'_> {
        match self {
            RawCall::AllGather { send, recv } => RawCall::AllGather { send, recv },
            RawCall::AllToAll { send, recv } => RawCall::AllToAll { send, recv },
            RawCall::AllToAllV { send, send_counts, recv, recv_counts } => {
                RawCall::AllToAllV { send, send_counts, recv, recv_counts }
            }
            RawCall::ReduceScatter { send, recv } => RawCall::ReduceScatter { send, recv },
            RawCall::AllReduce { buf } => RawCall::AllReduce { buf },
            RawCall::Broadcast { root, buf } => RawCall::Broadcast { root: *root, buf },
            RawCall::Barrier => RawCall::Barrier,
        }
    }

    /// Counts the traffic of this (successful) call by member `index` of `group`:
    /// the table of the checked methods' docs.
    fn record(&self, traffic: &mut TrafficCounter, group: &Group, index: usize) {
        let (p, shape) = self.shape();
        record_of(traffic, group, index, p, &shape);
    }
}

/// Counts the traffic of a successful call of `p` by member `index` of `group`
/// with lengths `shape` (bytes; elements for the f32 primitives; the broadcast
/// buffer and the all-reduce vector in `send`): the table of the checked
/// methods' docs. Host calls and device calls (`device::DeviceCommunicator`)
/// both count through it.
pub(crate) fn record_of(
    traffic: &mut TrafficCounter,
    group: &Group,
    index: usize,
    p: Primitive,
    shape: &check::Shape<'_>,
) {
    let each = |traffic: &mut TrafficCounter, bytes: usize| {
        for &peer in group.ranks() {
            traffic.record_send(peer, bytes);
            traffic.record_recv(peer, bytes);
        }
    };
    match p {
        Primitive::AllGather => each(traffic, shape.send),
        Primitive::AllToAll => each(traffic, shape.send / group.size()),
        Primitive::AllToAllV => {
            for ((&peer, &s), &r) in group.ranks().iter().zip(shape.send_counts).zip(shape.recv_counts) {
                traffic.record_send(peer, s);
                traffic.record_recv(peer, r);
            }
        }
        Primitive::ReduceScatter => each(traffic, 4 * shape.recv),
        Primitive::AllReduce => {
            let k = shape.send.div_ceil(group.size());
            each(traffic, 4 * k);
            each(traffic, 4 * k);
        }
        Primitive::Broadcast if shape.root == index => {
            group.ranks().iter().for_each(|&peer| traffic.record_send(peer, shape.send));
        }
        Primitive::Broadcast => {
            if let Some(r) = group.rank_at(shape.root) {
                traffic.record_recv(r, shape.send);
            }
        }
        Primitive::Barrier => each(traffic, 0),
    }
}

/// The checked path of every primitive: the group, then the arguments (a
/// rejection goes through [`Communicator::raw_reject`]), the backend's hook, and
/// the traffic once the hook succeeded.
fn checked<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    mut call: RawCall<'_>,
) -> Result<(), CommError> {
    let (p, shape) = call.shape();
    let me = check::member(comm.topology(), comm.rank(), group, p)?;
    if let Err(e) = check::arguments_of(group, me, p, &shape) {
        return Err(comm.raw_reject(group, me, p, e));
    }
    comm.raw(group, me, call.reborrow())?;
    call.record(comm.traffic_mut(), group, me);
    Ok(())
}

/// A rank's handle on the job: group collectives on byte and `f32` buffers.
///
/// All members of `group` must call the same collective, in the same order, with
/// consistent sizes; a mismatch is reported as [`CommError::Mismatch`], a vanished
/// peer as [`CommError::PeerLost`], never as garbage or a hang.
///
/// Chunks are laid out in *group order*: chunk `i` of a gathered buffer came from
/// `group.ranks()[i]`, chunk `i` of a scattered buffer goes to `group.ranks()[i]`.
///
/// Every primitive first checks its arguments, in this order, on every backend:
/// every member of `group` lies inside the world and the caller is a member
/// ([`CommError::InvalidGroup`]); then the buffer lengths and counts
/// ([`CommError::Mismatch`]) or the broadcast root ([`CommError::InvalidGroup`]).
///
/// ```
/// use zeropp_comm::{CommError, Communicator, Group, ThreadCluster, ThreadOptions, Topology};
/// let cluster = ThreadCluster::new(Topology::ranks(2).per_node(2)?, ThreadOptions::default());
/// cluster.run(|comm| {
///     let world = Group::world(comm.topology());
///     // A receive buffer one byte short: the same error on every backend.
///     let err = comm.all_gather_bytes(&world, &[1, 2], &mut [0u8; 3]).unwrap_err();
///     assert_eq!(
///         err,
///         CommError::Mismatch("all_gather: receive buffer of 3 bytes for 2 chunks of 2 bytes".into())
///     );
///     let mut all = [0u8; 4];
///     comm.all_gather_bytes(&world, &[comm.rank() as u8; 2], &mut all)?;
///     assert_eq!(all, [0, 0, 1, 1]);
///     Ok::<_, CommError>(())
/// })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait Communicator: Send {
    /// This rank's global rank (by default, the rank its traffic is counted for).
    fn rank(&self) -> usize {
        self.traffic().rank()
    }

    /// The job's topology (by default, the one its traffic is classed by).
    fn topology(&self) -> &Topology {
        self.traffic().topology()
    }

    /// The traffic counters of this communicator.
    fn traffic(&self) -> &TrafficCounter;

    /// Mutable traffic counters: set the operation tag, reset.
    fn traffic_mut(&mut self) -> &mut TrafficCounter;

    /// Gathers `send` from every member: `recv.len() == send.len() * group.size()`.
    ///
    /// Validates, calls [`Communicator::raw`] with [`RawCall::AllGather`], then
    /// counts `send.len()` bytes to and from every other member.
    fn all_gather_bytes(&mut self, group: &Group, send: &[u8], recv: &mut [u8]) -> Result<(), CommError> {
        checked(self, group, RawCall::AllGather { send, recv })
    }

    /// Equal-chunk all-to-all: chunk `i` of `send` goes to member `i`; chunk `j` of
    /// `recv` comes from member `j`. Both lengths are `chunk * group.size()`.
    ///
    /// Validates, calls [`Communicator::raw`] with [`RawCall::AllToAll`], then
    /// counts one chunk to and from every other member.
    fn all_to_all_bytes(&mut self, group: &Group, send: &[u8], recv: &mut [u8]) -> Result<(), CommError> {
        checked(self, group, RawCall::AllToAll { send, recv })
    }

    /// Variable-chunk all-to-all: `send_counts[i]` bytes (consecutive in `send`) go to
    /// member `i`; `recv_counts[j]` bytes (consecutive in `recv`) come from member `j`.
    ///
    /// Validates (one count per member, counts adding up to the buffer lengths, the
    /// caller's own chunk the same both ways), calls [`Communicator::raw`] with
    /// [`RawCall::AllToAllV`], then counts `send_counts[j]` bytes to and
    /// `recv_counts[j]` from every other member `j`.
    fn all_to_all_v_bytes(
        &mut self,
        group: &Group,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        checked(self, group, RawCall::AllToAllV { send, send_counts, recv, recv_counts })
    }

    /// Sum-reduce-scatter: `send.len() == recv.len() * group.size()`; member `i`
    /// receives the element-wise sum of chunk `i` over all members, summed in group
    /// order starting from zero.
    ///
    /// Validates, calls [`Communicator::raw`] with [`RawCall::ReduceScatter`], then
    /// counts `4·recv.len()` bytes to and from every other member.
    fn reduce_scatter_f32(&mut self, group: &Group, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        checked(self, group, RawCall::ReduceScatter { send, recv })
    }

    /// Element-wise sum over all members, in place (in group order, from zero).
    ///
    /// Validates the group, calls [`Communicator::raw`] with [`RawCall::AllReduce`],
    /// then counts a reduce-scatter and an all-gather of `⌈n/g⌉` floats: `4·⌈n/g⌉`
    /// bytes to and from every other member, twice.
    fn all_reduce_f32(&mut self, group: &Group, buf: &mut [f32]) -> Result<(), CommError> {
        checked(self, group, RawCall::AllReduce { buf })
    }

    /// Copies `buf` of the member at group index `root` into every member's `buf`.
    ///
    /// Validates, calls [`Communicator::raw`] with [`RawCall::Broadcast`], then
    /// counts `buf.len()` bytes from the root to every other member.
    fn broadcast_bytes(&mut self, group: &Group, root: usize, buf: &mut [u8]) -> Result<(), CommError> {
        checked(self, group, RawCall::Broadcast { root, buf })
    }

    /// Returns once every member has entered the barrier.
    ///
    /// Validates the group, calls [`Communicator::raw`] with [`RawCall::Barrier`],
    /// then counts one empty message to and from every other member.
    fn barrier(&mut self, group: &Group) -> Result<(), CommError> {
        checked(self, group, RawCall::Barrier)
    }

    /// Collective over the world: an independent communicator on the same ranks
    /// (like `MPI_Comm_dup`), so a second stream of collectives (a prefetch on
    /// another thread) never interleaves with this one.
    fn duplicate(&mut self) -> Result<Box<dyn Communicator>, CommError>;

    /// The backend hook of every primitive, called by the checked methods with
    /// valid arguments (see [`RawCall`]); the caller is member `index` of `group`.
    /// Counts no traffic. Callers use the checked methods instead.
    fn raw(&mut self, group: &Group, index: usize, call: RawCall<'_>) -> Result<(), CommError>;

    /// Backend hook called instead of [`Communicator::raw`] when the caller (member
    /// `index` of `group`) passed invalid arguments to `primitive`; `error` says
    /// why, and the returned error is what the caller gets.
    ///
    /// The default returns `error` unchanged: the caller's peers block in the
    /// collective until the caller's failure reaches them (the thread backend
    /// reports the rank as lost once its closure returns). A backend whose peers
    /// would otherwise wait forever overrides it to take part in the collective's
    /// agreement step, so that every member fails (the MPI backend).
    fn raw_reject(
        &mut self,
        group: &Group,
        index: usize,
        primitive: Primitive,
        error: CommError,
    ) -> CommError {
        let _ = (group, index, primitive);
        error
    }
}
