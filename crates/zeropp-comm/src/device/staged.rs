//! The host [`Communicator`] on a [`DeviceComm`]: every primitive uploads the
//! caller's host buffers, runs the device primitive ([`DeviceCommunicator::raw`])
//! and downloads the result. So host code (the conformance suite, the host
//! ZeRO++ collectives) runs unchanged on the one-device cluster; validation and
//! counting are the host trait's provided methods.
//!

use super::{Device, DeviceBuf, DeviceCall, DeviceComm, DeviceCommunicator};
use crate::{CommError, Communicator, Group, RawCall, Topology, TrafficCounter};

impl<D: Device> DeviceComm<D> {
    fn staged(&mut self, group: &Group, index: usize, call: RawCall<'_>) -> Result<(), CommError> {
        let dev = self.device().clone();
        let up = |c: &Self, b: &[u8]| DeviceBuf::from_bytes(&dev, c.stream(), b);
        let zero = |n: usize| DeviceBuf::<D>::zeroed(&dev, n);
        let down = |c: &Self, d: &DeviceBuf<D>, out: &mut [u8]| dev.download(c.stream(), d.view(), out);
        match call {
            RawCall::AllGather { send, recv } => {
                let (s, r) = (up(self, send)?, zero(recv.len())?);
                DeviceCommunicator::raw(
                    self,
                    group,
                    index,
                    DeviceCall::AllGather { send: s.view(), recv: r.view() },
                )?;
                down(self, &r, recv)
            }
            RawCall::AllToAll { send, recv } => {
                let (s, r) = (up(self, send)?, zero(recv.len())?);
                DeviceCommunicator::raw(
                    self,
                    group,
                    index,
                    DeviceCall::AllToAll { send: s.view(), recv: r.view() },
                )?;
                down(self, &r, recv)
            }
            RawCall::AllToAllV { send, send_counts, recv, recv_counts } => {
                let (s, r) = (up(self, send)?, zero(recv.len())?);
                let call = DeviceCall::AllToAllV { send: s.view(), send_counts, recv: r.view(), recv_counts };
                DeviceCommunicator::raw(self, group, index, call)?;
                down(self, &r, recv)
            }
            RawCall::ReduceScatter { send, recv } => {
                let (s, r) = (up(self, bytemuck::cast_slice(send))?, zero(4 * recv.len())?);
                DeviceCommunicator::raw(
                    self,
                    group,
                    index,
                    DeviceCall::ReduceScatterF32 { send: s.view(), recv: r.view() },
                )?;
                down(self, &r, bytemuck::cast_slice_mut(recv))
            }
            RawCall::AllReduce { buf } => {
                let b = up(self, bytemuck::cast_slice(buf))?;
                DeviceCommunicator::raw(self, group, index, DeviceCall::AllReduceF32 { buf: b.view() })?;
                down(self, &b, bytemuck::cast_slice_mut(buf))
            }
            RawCall::Broadcast { root, buf } => {
                let b = up(self, buf)?;
                DeviceCommunicator::raw(self, group, index, DeviceCall::Broadcast { root, buf: b.view() })?;
                down(self, &b, buf)
            }
            RawCall::Barrier => DeviceCommunicator::raw(self, group, index, DeviceCall::Barrier),
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

    fn raw(&mut self, group: &Group, index: usize, call: RawCall<'_>) -> Result<(), CommError> {
        self.staged(group, index, call)
    }
}
