//! The MPI collectives behind each [`RawCall`] of [`MpiComm`], called after
//! `Env::check_thread`: one MPI call per primitive, `Reduction::Ordered` sums
//! in group order (bit-identical to the thread backend).

use ::mpi::collective::{CommunicatorCollectives, Root, SystemOperation};
use ::mpi::datatype::{Partition, PartitionMut};
use ::mpi::topology::Communicator as _;

use super::super::Reduction;
use super::{
    CHUNK, LENGTH, MpiComm, ROOT, count, displacements, ordered_sum, real_ptr, real_ptr_mut, single_member,
    too_big,
};
use crate::slices::{copy_to, window};
use crate::{CommError, Group};

/// The primitives behind [`RawCall`]s, called after `Env::check_thread`.
impl MpiComm {
    /// [`RawCall::AllToAllV`]: the counts are checked against the peers' (one
    /// `MPI_Alltoall`), then one `MPI_Alltoallv`.
    pub(super) fn mpi_all_to_all_v(
        &mut self,
        group: &Group,
        send: (&[u8], &[usize]),
        recv: (&mut [u8], &[usize]),
    ) -> Result<(), CommError> {
        let ((send, send_counts), (recv, recv_counts)) = (send, recv);
        const OP: &str = "all_to_all_v";
        let g = group.size();
        let mut local = too_big(OP, "the send buffer", send.len())
            .or_else(|| too_big(OP, "the receive buffer", recv.len()));
        if g == 1 {
            return single_member(local, || copy_to(recv, 0, send, "all_to_all_v: receive buffer"));
        }
        self.ensure(group)?;
        // Every member learns what each peer will send it and compares it with what
        // it expects (one MPI_Alltoall of counts), then all agree on the outcome.
        let announced: Vec<u64> =
            if local.is_some() { vec![u64::MAX; g] } else { send_counts.iter().map(|&c| c as u64).collect() };
        let mut incoming = vec![0u64; g];
        self.comm_of(group)?.all_to_all_into(&announced[..], &mut incoming[..]);
        if local.is_none()
            && let Some((j, (&got, &want))) =
                incoming.iter().zip(recv_counts).enumerate().find(|&(_, (&got, &want))| got != want as u64)
        {
            local = Some(if got == u64::MAX {
                CommError::Mismatch(format!(
                    "{OP}: group member {j} (rank {}) rejected its arguments (see its error)",
                    group.rank_at(j).unwrap_or(usize::MAX)
                ))
            } else {
                CommError::Mismatch(format!(
                    "{OP}: rank {} sends {got} bytes to rank {} but {want} were expected",
                    group.rank_at(j).unwrap_or(usize::MAX),
                    self.rank
                ))
            });
        }
        self.prepare(group, OP, &[], local, true)?;
        let sc: Vec<i32> = send_counts.iter().map(|&c| count(c)).collect();
        let rc: Vec<i32> = recv_counts.iter().map(|&c| count(c)).collect();
        let (sd, rd) = (displacements(send_counts), displacements(recv_counts));
        let (s0, mut r0) = ([0u8; 1], [0u8; 1]);
        let send_part = Partition::new(real_ptr(send, &s0), &sc[..], &sd[..]);
        let mut recv_part = PartitionMut::new(real_ptr_mut(recv, &mut r0), &rc[..], &rd[..]);
        self.comm_of(group)?.all_to_all_varcount_into(&send_part, &mut recv_part);
        Ok(())
    }

    /// [`RawCall::ReduceScatter`] by [`MpiOptions::reduction`].
    pub(super) fn mpi_reduce_scatter(
        &mut self,
        group: &Group,
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), CommError> {
        const OP: &str = "reduce_scatter";
        let (g, n) = (group.size(), recv.len());
        let local = too_big(OP, "a chunk", n);
        if g == 1 {
            return single_member(local, || {
                ordered_sum(recv, send);
                Ok(())
            });
        }
        self.prepare(group, OP, &[(CHUNK, n as u64)], local, false)?;
        let comm = self.comm_of(group)?;
        match self.options.reduction {
            Reduction::Native => comm.reduce_scatter_block_into(send, recv, SystemOperation::sum()),
            Reduction::Ordered => {
                let mut gathered = vec![0.0f32; n * g];
                comm.all_to_all_into(send, &mut gathered[..]);
                ordered_sum(recv, &gathered);
            }
        }
        Ok(())
    }

    /// [`RawCall::AllReduce`] by [`MpiOptions::reduction`].
    pub(super) fn mpi_all_reduce(&mut self, group: &Group, buf: &mut [f32]) -> Result<(), CommError> {
        const OP: &str = "all_reduce";
        let (g, n) = (group.size(), buf.len());
        let local = too_big(OP, "the buffer", n.div_ceil(g) * g);
        if g == 1 {
            // Same rounding as the thread backend: 0 + x (turns -0.0 into +0.0).
            return single_member(local, || {
                buf.iter_mut().for_each(|x| *x += 0.0);
                Ok(())
            });
        }
        self.prepare(group, OP, &[(LENGTH, n as u64)], local, false)?;
        let comm = self.comm_of(group)?;
        match self.options.reduction {
            Reduction::Native => {
                let send = buf.to_vec();
                comm.all_reduce_into(&send[..], buf, SystemOperation::sum());
            }
            Reduction::Ordered => {
                // The thread backend's algorithm: reduce-scatter of ⌈n/g⌉-element chunks
                // (zero-padded), summed in group order, then an all-gather.
                let c = n.div_ceil(g);
                let mut padded = vec![0.0f32; c * g];
                copy_to(&mut padded, 0, buf, "all_reduce: padded buffer")?;
                let mut chunks = vec![0.0f32; c * g];
                comm.all_to_all_into(&padded[..], &mut chunks[..]);
                let mut mine = vec![0.0f32; c];
                ordered_sum(&mut mine, &chunks);
                comm.all_gather_into(&mine[..], &mut padded[..]);
                buf.copy_from_slice(window(&padded, 0, n, "all_reduce: padded buffer")?);
            }
        }
        Ok(())
    }

    /// [`RawCall::Broadcast`]: members agree on the length and the root first.
    pub(super) fn mpi_broadcast(
        &mut self,
        group: &Group,
        root: usize,
        buf: &mut [u8],
    ) -> Result<(), CommError> {
        const OP: &str = "broadcast";
        let n = buf.len();
        let local = too_big(OP, "the buffer", n);
        if group.size() == 1 {
            return local.map_or(Ok(()), Err);
        }
        self.prepare(group, OP, &[(LENGTH, n as u64), (ROOT, root as u64)], local, false)?;
        let mut r0 = [0u8; 1];
        self.comm_of(group)?.process_at_rank(count(root)).broadcast_into(real_ptr_mut(buf, &mut r0));
        Ok(())
    }
}
