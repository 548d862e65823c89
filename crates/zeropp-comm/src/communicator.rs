//! The [`Communicator`] trait: the few group primitives every backend provides.
//!
//! The ZeRO++ collectives (`crate::collectives`) are written once on top of these
//! primitives. A backend never assumes that ranks share an address space: every
//! buffer is the caller's, every result is written into a caller buffer.

use crate::{CommError, Group, Topology, TrafficCounter};

/// A rank's handle on the job: group collectives on byte and `f32` buffers.
///
/// All members of `group` must call the same collective, in the same order, with
/// consistent sizes; a mismatch is reported as [`CommError::Mismatch`], a vanished
/// peer as [`CommError::PeerLost`], never as garbage or a hang.
///
/// Chunks are laid out in *group order*: chunk `i` of a gathered buffer came from
/// `group.ranks()[i]`, chunk `i` of a scattered buffer goes to `group.ranks()[i]`.
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
    fn all_gather_bytes(&mut self, group: &Group, send: &[u8], recv: &mut [u8]) -> Result<(), CommError>;

    /// Equal-chunk all-to-all: chunk `i` of `send` goes to member `i`; chunk `j` of
    /// `recv` comes from member `j`. Both lengths are `chunk * group.size()`.
    fn all_to_all_bytes(&mut self, group: &Group, send: &[u8], recv: &mut [u8]) -> Result<(), CommError>;

    /// Variable-chunk all-to-all: `send_counts[i]` bytes (consecutive in `send`) go to
    /// member `i`; `recv_counts[j]` bytes (consecutive in `recv`) come from member `j`.
    fn all_to_all_v_bytes(
        &mut self,
        group: &Group,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<(), CommError>;

    /// Sum-reduce-scatter: `send.len() == recv.len() * group.size()`; member `i`
    /// receives the element-wise sum of chunk `i` over all members.
    fn reduce_scatter_f32(&mut self, group: &Group, send: &[f32], recv: &mut [f32]) -> Result<(), CommError>;

    /// Element-wise sum over all members, in place.
    fn all_reduce_f32(&mut self, group: &Group, buf: &mut [f32]) -> Result<(), CommError>;

    /// Copies `buf` of the member at group index `root` into every member's `buf`.
    fn broadcast_bytes(&mut self, group: &Group, root: usize, buf: &mut [u8]) -> Result<(), CommError>;

    /// Returns once every member has entered the barrier.
    fn barrier(&mut self, group: &Group) -> Result<(), CommError>;

    /// Collective over the world: an independent communicator on the same ranks
    /// (like `MPI_Comm_dup`), so a second stream of collectives (a prefetch on
    /// another thread) never interleaves with this one.
    fn duplicate(&mut self) -> Result<Box<dyn Communicator>, CommError>;
}
