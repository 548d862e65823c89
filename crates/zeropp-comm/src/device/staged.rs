//! The host [`Communicator`] on a [`DeviceComm`]: every primitive uploads the
//! caller's host buffers, runs the device primitive ([`DeviceCommunicator::raw`])
//! and downloads the result. So host code (the conformance suite, the host
//! ZeRO++ collectives) runs unchanged on the one-device cluster; validation and
//! counting are the host trait's provided methods.
//!

use super::{Device, DeviceBuf, DeviceCall, DeviceComm, DeviceCommunicator, View};
use crate::{CommError, Communicator, Group, RawCall, Topology, TrafficCounter};

impl<D: Device> DeviceComm<D> {
    fn staged(&mut self, group: &Group, index: usize, call: RawCall<'_>) -> Result<(), CommError> {
        match call {
            RawCall::AllGather { send, recv } => {
                self.staged_pair(group, index, send, recv, |send, recv| DeviceCall::AllGather { send, recv })
            }
            RawCall::AllToAll { send, recv } => {
                self.staged_pair(group, index, send, recv, |send, recv| DeviceCall::AllToAll { send, recv })
            }
            RawCall::AllToAllV { send, send_counts, recv, recv_counts } => {
                let (s, r) = (self.upload(send)?, DeviceBuf::zeroed(self.device(), recv.len())?);
                let call = DeviceCall::AllToAllV { send: s.view(), send_counts, recv: r.view(), recv_counts };
                DeviceCommunicator::raw(self, group, index, call)?;
                self.download(&r, recv)
            }
            RawCall::ReduceScatter { send, recv } => self.staged_pair(
                group,
                index,
                bytemuck::cast_slice(send),
                bytemuck::cast_slice_mut(recv),
                |send, recv| DeviceCall::ReduceScatterF32 { send, recv },
            ),
            RawCall::AllReduce { buf } => {
                self.staged_in_place(group, index, bytemuck::cast_slice_mut(buf), |buf| {
                    DeviceCall::AllReduceF32 { buf }
                })
            }
            RawCall::Broadcast { root, buf } => {
                self.staged_in_place(group, index, buf, |buf| DeviceCall::Broadcast { root, buf })
            }
            RawCall::Barrier => DeviceCommunicator::raw(self, group, index, DeviceCall::Barrier),
        }
    }

    /// `bytes` in a new device buffer, uploaded on this rank's stream.
    fn upload(&self, bytes: &[u8]) -> Result<DeviceBuf<D>, CommError> {
        DeviceBuf::from_bytes(self.device(), self.stream(), bytes)
    }

    /// Downloads `buf` into `out`.
    fn download(&self, buf: &DeviceBuf<D>, out: &mut [u8]) -> Result<(), CommError> {
        self.device().download(self.stream(), buf.view(), out)
    }

    /// A call on a send and a receive buffer (`make(send, recv)`), staged.
    fn staged_pair(
        &mut self,
        group: &Group,
        index: usize,
        send: &[u8],
        recv: &mut [u8],
        make: impl for<'v> FnOnce(View<'v, D>, View<'v, D>) -> DeviceCall<'v, D>,
    ) -> Result<(), CommError> {
        let (s, r) = (self.upload(send)?, DeviceBuf::zeroed(self.device(), recv.len())?);
        DeviceCommunicator::raw(self, group, index, make(s.view(), r.view()))?;
        self.download(&r, recv)
    }

    /// A call on one buffer, in place (`make(buf)`), staged.
    fn staged_in_place(
        &mut self,
        group: &Group,
        index: usize,
        buf: &mut [u8],
        make: impl for<'v> FnOnce(View<'v, D>) -> DeviceCall<'v, D>,
    ) -> Result<(), CommError> {
        let b = self.upload(buf)?;
        DeviceCommunicator::raw(self, group, index, make(b.view()))?;
        self.download(&b, buf)
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

    fn raw(&mut self, group: &Group, index: usize, call: RawCall<'_>) -> Result<(), CommError> {
        self.staged(group, index, call)
    }
}
