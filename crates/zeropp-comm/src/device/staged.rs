//! The host [`Communicator`] on a [`DeviceComm`]: every primitive uploads the
//! caller's host buffers, runs the device primitive ([`DeviceCommunicator::raw`])
//! and downloads the result. So host code (the conformance suite, the host
//! ZeRO++ collectives) runs unchanged on the one-device cluster; validation and
//! counting are the host trait's provided methods.
//!
//! Every hook funnels into [`DeviceComm::staged`], one place to adapt when the
//! host trait's hooks change shape.

use super::{Device, DeviceBuf, DeviceCall, DeviceComm, DeviceCommunicator};
use crate::{CommError, Communicator, Group, Topology, TrafficCounter};

/// A host call, as buffers to stage.
enum Host<'a> {
    AllGather(&'a [u8], &'a mut [u8]),
    AllToAll(&'a [u8], &'a mut [u8]),
    AllToAllV(&'a [u8], &'a [usize], &'a mut [u8], &'a [usize]),
    ReduceScatter(&'a [f32], &'a mut [f32]),
    AllReduce(&'a mut [f32]),
    Broadcast(usize, &'a mut [u8]),
    Barrier,
}

impl<D: Device> DeviceComm<D> {
    fn staged(&mut self, group: &Group, index: usize, call: Host<'_>) -> Result<(), CommError> {
        let dev = self.device().clone();
        let up = |c: &Self, b: &[u8]| DeviceBuf::from_bytes(&dev, c.stream(), b);
        let zero = |n: usize| DeviceBuf::<D>::zeroed(&dev, n);
        let down = |c: &Self, d: &DeviceBuf<D>, out: &mut [u8]| dev.download(c.stream(), d.view(), out);
        match call {
            Host::AllGather(send, recv) => {
                let (s, r) = (up(self, send)?, zero(recv.len())?);
                self.raw(group, index, DeviceCall::AllGather { send: s.view(), recv: r.view() })?;
                down(self, &r, recv)
            }
            Host::AllToAll(send, recv) => {
                let (s, r) = (up(self, send)?, zero(recv.len())?);
                self.raw(group, index, DeviceCall::AllToAll { send: s.view(), recv: r.view() })?;
                down(self, &r, recv)
            }
            Host::AllToAllV(send, send_counts, recv, recv_counts) => {
                let (s, r) = (up(self, send)?, zero(recv.len())?);
                let call = DeviceCall::AllToAllV { send: s.view(), send_counts, recv: r.view(), recv_counts };
                self.raw(group, index, call)?;
                down(self, &r, recv)
            }
            Host::ReduceScatter(send, recv) => {
                let (s, r) = (up(self, bytemuck::cast_slice(send))?, zero(4 * recv.len())?);
                self.raw(group, index, DeviceCall::ReduceScatterF32 { send: s.view(), recv: r.view() })?;
                down(self, &r, bytemuck::cast_slice_mut(recv))
            }
            Host::AllReduce(buf) => {
                let b = up(self, bytemuck::cast_slice(buf))?;
                self.raw(group, index, DeviceCall::AllReduceF32 { buf: b.view() })?;
                down(self, &b, bytemuck::cast_slice_mut(buf))
            }
            Host::Broadcast(root, buf) => {
                let b = up(self, buf)?;
                self.raw(group, index, DeviceCall::Broadcast { root, buf: b.view() })?;
                down(self, &b, buf)
            }
            Host::Barrier => self.raw(group, index, DeviceCall::Barrier),
        }
    }
}

impl<D: Device> Communicator for DeviceComm<D> {
    fn rank(&self) -> usize {
        DeviceComm::rank(self)
    }

    fn topology(&self) -> &Topology {
        DeviceComm::topology(self)
    }

    fn traffic(&self) -> &TrafficCounter {
        DeviceComm::traffic(self)
    }

    fn traffic_mut(&mut self) -> &mut TrafficCounter {
        DeviceComm::traffic_mut(self)
    }

    fn duplicate(&mut self) -> Result<Box<dyn Communicator>, CommError> {
        Ok(Box::new(self.dup()?))
    }

    fn raw_all_gather_bytes(
        &mut self,
        group: &Group,
        index: usize,
        send: &[u8],
        recv: &mut [u8],
    ) -> Result<(), CommError> {
        self.staged(group, index, Host::AllGather(send, recv))
    }

    fn raw_all_to_all_bytes(
        &mut self,
        group: &Group,
        index: usize,
        send: &[u8],
        recv: &mut [u8],
    ) -> Result<(), CommError> {
        self.staged(group, index, Host::AllToAll(send, recv))
    }

    fn raw_all_to_all_v_bytes(
        &mut self,
        group: &Group,
        index: usize,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        self.staged(group, index, Host::AllToAllV(send, send_counts, recv, recv_counts))
    }

    fn raw_reduce_scatter_f32(
        &mut self,
        group: &Group,
        index: usize,
        send: &[f32],
        recv: &mut [f32],
    ) -> Result<(), CommError> {
        self.staged(group, index, Host::ReduceScatter(send, recv))
    }

    fn raw_all_reduce_f32(&mut self, group: &Group, index: usize, buf: &mut [f32]) -> Result<(), CommError> {
        self.staged(group, index, Host::AllReduce(buf))
    }

    fn raw_broadcast_bytes(
        &mut self,
        group: &Group,
        index: usize,
        root: usize,
        buf: &mut [u8],
    ) -> Result<(), CommError> {
        self.staged(group, index, Host::Broadcast(root, buf))
    }

    fn raw_barrier(&mut self, group: &Group, index: usize) -> Result<(), CommError> {
        self.staged(group, index, Host::Barrier)
    }
}
