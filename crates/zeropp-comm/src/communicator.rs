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
//! backend's `raw_*` hook, and count the traffic once the hook succeeded (so every
//! backend counts the same bytes, see [`crate::threads`] for the table). A backend
//! implements only the hooks, which may assume valid arguments, plus
//! [`Communicator::raw_reject`] when its peers must learn that a member rejected
//! its arguments (the MPI backend does, so no peer waits forever).

use std::fmt;

use crate::{CommError, Group, Topology, TrafficCounter, check};

/// A primitive of [`Communicator`], by the name error messages use.
///
/// ```
/// use zeropp_comm::Primitive;
/// assert_eq!(Primitive::AllToAllV.name(), "all_to_all_v");
/// assert_eq!(Primitive::ALL.len(), 7);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Primitive {
    /// [`Communicator::all_gather_bytes`].
    AllGather,
    /// [`Communicator::all_to_all_bytes`].
    AllToAll,
    /// [`Communicator::all_to_all_v_bytes`].
    AllToAllV,
    /// [`Communicator::reduce_scatter_f32`].
    ReduceScatter,
    /// [`Communicator::all_reduce_f32`].
    AllReduce,
    /// [`Communicator::broadcast_bytes`].
    Broadcast,
    /// [`Communicator::barrier`].
    Barrier,
}

impl Primitive {
    /// Every primitive, in declaration order.
    pub const ALL: [Primitive; 7] = [
        Primitive::AllGather,
        Primitive::AllToAll,
        Primitive::AllToAllV,
        Primitive::ReduceScatter,
        Primitive::AllReduce,
        Primitive::Broadcast,
        Primitive::Barrier,
    ];

    /// The name in error messages: `all_gather`, `all_to_all`, `all_to_all_v`,
    /// `reduce_scatter`, `all_reduce`, `broadcast` or `barrier`.
    pub fn name(self) -> &'static str {
        match self {
            Primitive::AllGather => "all_gather",
            Primitive::AllToAll => "all_to_all",
            Primitive::AllToAllV => "all_to_all_v",
            Primitive::ReduceScatter => "reduce_scatter",
            Primitive::AllReduce => "all_reduce",
            Primitive::Broadcast => "broadcast",
            Primitive::Barrier => "barrier",
        }
    }
}

impl fmt::Display for Primitive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Records one message of `bytes` to and one from every other member of `group`
/// (the counter skips the caller itself).
fn record_exchange(traffic: &mut TrafficCounter, group: &Group, bytes: usize) {
    for &peer in group.ranks() {
        traffic.record_send(peer, bytes);
        traffic.record_recv(peer, bytes);
    }
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
    /// This rank's global rank.
    fn rank(&self) -> usize;

    /// The job's topology.
    fn topology(&self) -> &Topology;

    /// The traffic counters of this communicator.
    fn traffic(&self) -> &TrafficCounter;

    /// Mutable traffic counters: set the operation tag, reset.
    fn traffic_mut(&mut self) -> &mut TrafficCounter;

    /// Gathers `send` from every member: `recv.len() == send.len() * group.size()`.
    ///
    /// Validates, calls [`Communicator::raw_all_gather_bytes`], then counts
    /// `send.len()` bytes to and from every other member.
    fn all_gather_bytes(&mut self, group: &Group, send: &[u8], recv: &mut [u8]) -> Result<(), CommError> {
        let p = Primitive::AllGather;
        let me = check::member(self.topology(), self.rank(), group, p)?;
        if let Err(e) = check::all_gather(group, send.len(), recv.len()) {
            return Err(self.raw_reject(group, me, p, e));
        }
        self.raw_all_gather_bytes(group, me, send, recv)?;
        record_exchange(self.traffic_mut(), group, send.len());
        Ok(())
    }

    /// Equal-chunk all-to-all: chunk `i` of `send` goes to member `i`; chunk `j` of
    /// `recv` comes from member `j`. Both lengths are `chunk * group.size()`.
    ///
    /// Validates, calls [`Communicator::raw_all_to_all_bytes`], then counts one
    /// chunk to and from every other member.
    fn all_to_all_bytes(&mut self, group: &Group, send: &[u8], recv: &mut [u8]) -> Result<(), CommError> {
        let p = Primitive::AllToAll;
        let me = check::member(self.topology(), self.rank(), group, p)?;
        let chunk = match check::all_to_all(group, send.len(), recv.len()) {
            Ok(c) => c,
            Err(e) => return Err(self.raw_reject(group, me, p, e)),
        };
        self.raw_all_to_all_bytes(group, me, send, recv)?;
        record_exchange(self.traffic_mut(), group, chunk);
        Ok(())
    }

    /// Variable-chunk all-to-all: `send_counts[i]` bytes (consecutive in `send`) go to
    /// member `i`; `recv_counts[j]` bytes (consecutive in `recv`) come from member `j`.
    ///
    /// Validates (one count per member, counts adding up to the buffer lengths, the
    /// caller's own chunk the same both ways), calls
    /// [`Communicator::raw_all_to_all_v_bytes`], then counts `send_counts[j]` bytes
    /// to and `recv_counts[j]` from every other member `j`.
    fn all_to_all_v_bytes(
        &mut self,
        group: &Group,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let p = Primitive::AllToAllV;
        let me = check::member(self.topology(), self.rank(), group, p)?;
        if let Err(e) = check::all_to_all_v(group, me, send.len(), send_counts, recv.len(), recv_counts) {
            return Err(self.raw_reject(group, me, p, e));
        }
        self.raw_all_to_all_v_bytes(group, me, send, send_counts, recv, recv_counts)?;
        let traffic = self.traffic_mut();
        for ((&peer, &s), &r) in group.ranks().iter().zip(send_counts).zip(recv_counts) {
            traffic.record_send(peer, s);
            traffic.record_recv(peer, r);
        }
        Ok(())
    }

    /// Sum-reduce-scatter: `send.len() == recv.len() * group.size()`; member `i`
    /// receives the element-wise sum of chunk `i` over all members, summed in group
    /// order starting from zero.
    ///
    /// Validates, calls [`Communicator::raw_reduce_scatter_f32`], then counts
    /// `4·recv.len()` bytes to and from every other member.
    fn reduce_scatter_f32(&mut self, group: &Group, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let p = Primitive::ReduceScatter;
        let me = check::member(self.topology(), self.rank(), group, p)?;
        if let Err(e) = check::reduce_scatter(group, send.len(), recv.len()) {
            return Err(self.raw_reject(group, me, p, e));
        }
        self.raw_reduce_scatter_f32(group, me, send, recv)?;
        record_exchange(self.traffic_mut(), group, 4 * recv.len());
        Ok(())
    }

    /// Element-wise sum over all members, in place (in group order, from zero).
    ///
    /// Validates the group, calls [`Communicator::raw_all_reduce_f32`], then counts
    /// a reduce-scatter and an all-gather of `⌈n/g⌉` floats: `4·⌈n/g⌉` bytes to and
    /// from every other member, twice.
    fn all_reduce_f32(&mut self, group: &Group, buf: &mut [f32]) -> Result<(), CommError> {
        let me = check::member(self.topology(), self.rank(), group, Primitive::AllReduce)?;
        self.raw_all_reduce_f32(group, me, buf)?;
        let k = buf.len().div_ceil(group.size());
        let traffic = self.traffic_mut();
        record_exchange(traffic, group, 4 * k);
        record_exchange(traffic, group, 4 * k);
        Ok(())
    }

    /// Copies `buf` of the member at group index `root` into every member's `buf`.
    ///
    /// Validates, calls [`Communicator::raw_broadcast_bytes`], then counts
    /// `buf.len()` bytes from the root to every other member.
    fn broadcast_bytes(&mut self, group: &Group, root: usize, buf: &mut [u8]) -> Result<(), CommError> {
        let p = Primitive::Broadcast;
        let me = check::member(self.topology(), self.rank(), group, p)?;
        let root_rank = match check::broadcast(group, root) {
            Ok(r) => r,
            Err(e) => return Err(self.raw_reject(group, me, p, e)),
        };
        self.raw_broadcast_bytes(group, me, root, buf)?;
        let n = buf.len();
        let traffic = self.traffic_mut();
        if me == root {
            group.ranks().iter().for_each(|&peer| traffic.record_send(peer, n));
        } else {
            traffic.record_recv(root_rank, n);
        }
        Ok(())
    }

    /// Returns once every member has entered the barrier.
    ///
    /// Validates the group, calls [`Communicator::raw_barrier`], then counts one
    /// empty message to and from every other member.
    fn barrier(&mut self, group: &Group) -> Result<(), CommError> {
        let me = check::member(self.topology(), self.rank(), group, Primitive::Barrier)?;
        self.raw_barrier(group, me)?;
        record_exchange(self.traffic_mut(), group, 0);
        Ok(())
    }

    /// Collective over the world: an independent communicator on the same ranks
    /// (like `MPI_Comm_dup`), so a second stream of collectives (a prefetch on
    /// another thread) never interleaves with this one.
    fn duplicate(&mut self) -> Result<Box<dyn Communicator>, CommError>;

    /// Backend hook of [`Communicator::all_gather_bytes`], called with valid
    /// arguments: the caller is member `index` of `group` and
    /// `recv.len() == send.len() * group.size()`. Counts no traffic.
    /// Callers use the checked method instead.
    fn raw_all_gather_bytes(
        &mut self,
        group: &Group,
        index: usize,
        send: &[u8],
        recv: &mut [u8],
    ) -> Result<(), CommError>;

    /// Backend hook of [`Communicator::all_to_all_bytes`], called with valid
    /// arguments: the caller is member `index` and both buffers are
    /// `chunk * group.size()` bytes. Counts no traffic.
    fn raw_all_to_all_bytes(
        &mut self,
        group: &Group,
        index: usize,
        send: &[u8],
        recv: &mut [u8],
    ) -> Result<(), CommError>;

    /// Backend hook of [`Communicator::all_to_all_v_bytes`], called with valid
    /// arguments: the caller is member `index`, there is one count per member, the
    /// counts add up to the buffer lengths and `send_counts[index] ==
    /// recv_counts[index]`. Whether a peer sends what the caller expects is the
    /// hook's to find out. Counts no traffic.
    fn raw_all_to_all_v_bytes(
        &mut self,
        group: &Group,
        index: usize,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<(), CommError>;

    /// Backend hook of [`Communicator::reduce_scatter_f32`], called with valid
    /// arguments: the caller is member `index` and
    /// `send.len() == recv.len() * group.size()`. Counts no traffic.
    fn raw_reduce_scatter_f32(
        &mut self,
        group: &Group,
        index: usize,
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), CommError>;

    /// Backend hook of [`Communicator::all_reduce_f32`]; the caller is member
    /// `index` of `group`. Counts no traffic.
    fn raw_all_reduce_f32(&mut self, group: &Group, index: usize, buf: &mut [f32]) -> Result<(), CommError>;

    /// Backend hook of [`Communicator::broadcast_bytes`]; the caller is member
    /// `index` and `root` is a valid group index. Counts no traffic.
    fn raw_broadcast_bytes(
        &mut self,
        group: &Group,
        index: usize,
        root: usize,
        buf: &mut [u8],
    ) -> Result<(), CommError>;

    /// Backend hook of [`Communicator::barrier`]; the caller is member `index`.
    fn raw_barrier(&mut self, group: &Group, index: usize) -> Result<(), CommError>;

    /// Backend hook called instead of the `raw_*` hook of `primitive` when the
    /// caller (member `index` of `group`) passed invalid arguments; `error` says
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
