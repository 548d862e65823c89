//! Typed helpers over the byte-level [`Communicator`] primitives.
//!
//! [`CommExt`] is implemented for every `C: Communicator + ?Sized` (including
//! `dyn Communicator`). The helpers reinterpret `bytemuck::Pod` slices as bytes, so
//! they add no copies and put exactly the same bytes on the wire (and in the traffic
//! counters) as the byte primitive they wrap: `size_of::<T>()` bytes per element.

use bytemuck::Pod;

use crate::{CommError, Communicator, Group};

/// Typed (`Pod`) versions of the primitives, writing into caller buffers.
///
/// ```
/// use zeropp_comm::{CommExt, Group, ThreadCluster, ThreadOptions, Topology};
/// let cluster = ThreadCluster::new(Topology::ranks(4).per_node(2)?, ThreadOptions::default());
/// let out = cluster.run(|comm| {
///     let group = Group::world(comm.topology());
///     let mine = [comm.rank() as u32; 2];
///     let mut all = [0u32; 8];
///     comm.all_gather(&group, &mine, &mut all)?;
///     Ok::<_, zeropp_comm::CommError>(all)
/// })?;
/// assert_eq!(out[3], [0, 0, 1, 1, 2, 2, 3, 3]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait CommExt: Communicator {
    /// Labels the traffic that follows with `tag` (see [`crate::TrafficCounter::set_op`]).
    fn set_op(&mut self, tag: &str) {
        self.traffic_mut().set_op(tag);
    }

    /// Typed [`Communicator::all_gather_bytes`]: `recv.len() == send.len() * group.size()`.
    fn all_gather<T: Pod>(&mut self, group: &Group, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        self.all_gather_bytes(group, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))
    }

    /// Typed [`Communicator::all_to_all_bytes`] (equal chunks of `send.len() / group.size()` elements).
    fn all_to_all<T: Pod>(&mut self, group: &Group, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        self.all_to_all_bytes(group, bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))
    }

    /// Typed [`Communicator::all_to_all_v_bytes`]: each buffer with its counts, in
    /// elements.
    fn all_to_all_v<T: Pod>(
        &mut self,
        group: &Group,
        (send, send_counts): (&[T], &[usize]),
        (recv, recv_counts): (&mut [T], &[usize]),
    ) -> Result<(), CommError> {
        let size = std::mem::size_of::<T>();
        let sc: Vec<usize> = send_counts.iter().map(|c| c * size).collect();
        let rc: Vec<usize> = recv_counts.iter().map(|c| c * size).collect();
        self.all_to_all_v_bytes(group, bytemuck::cast_slice(send), &sc, bytemuck::cast_slice_mut(recv), &rc)
    }

    /// Typed [`Communicator::broadcast_bytes`] from the member at group index `root`.
    fn broadcast<T: Pod>(&mut self, group: &Group, root: usize, buf: &mut [T]) -> Result<(), CommError> {
        self.broadcast_bytes(group, root, bytemuck::cast_slice_mut(buf))
    }

    /// Sum of one `f32` over the group (an [`Communicator::all_reduce_f32`] of length 1).
    fn all_reduce_scalar_f32(&mut self, group: &Group, value: f32) -> Result<f32, CommError> {
        let mut buf = [value];
        self.all_reduce_f32(group, &mut buf)?;
        Ok(buf[0])
    }

    /// Logical OR of a flag over the group (e.g. "some rank saw a non-finite gradient").
    fn any(&mut self, group: &Group, flag: bool) -> Result<bool, CommError> {
        Ok(self.all_reduce_scalar_f32(group, if flag { 1.0 } else { 0.0 })? > 0.0)
    }
}

impl<C: Communicator + ?Sized> CommExt for C {}
