//! Argument checks: every primitive with every kind of bad argument gives exactly
//! the documented error (variant and words), on the thread backend and on any
//! backend that implements only the `raw` hook, because the checks live in the
//! [`Communicator`] trait's provided methods.

use zeropp_comm::conformance::check_argument_errors;
use zeropp_comm::{
    CommError, CommExt, Communicator, Group, Primitive, RawCall, ThreadCluster, ThreadOptions, Topology,
    TrafficCounter,
};

#[test]
fn thread_backend_reports_the_documented_errors() {
    for (world, local) in [(1, 1), (2, 1), (2, 2), (4, 2), (6, 3), (8, 4)] {
        let t = Topology::ranks(world).per_node(local).unwrap();
        let checks = ThreadCluster::new(t, ThreadOptions::default())
            .run(check_argument_errors)
            .unwrap_or_else(|e| panic!("{world}x{local}: {e}"));
        assert!(checks.iter().all(|&c| c == checks[0] && c >= 20), "{world}x{local}: {checks:?}");
    }
}

/// A few of the messages spelled out, with the order of the checks: the group
/// first (outside the world, then membership), then the arguments.
#[test]
fn messages_and_check_order() {
    let t = Topology::ranks(4).per_node(2).unwrap();
    ThreadCluster::new(t, ThreadOptions::default())
        .run(|comm| -> Result<(), CommError> {
            let me = comm.rank();
            let world = Group::world(&t);
            let other_node = Group::intra_node(&t, (me + 2) % 4);
            // Not a member, and a receive buffer of the wrong size: the group wins.
            let e = comm.all_gather_bytes(&other_node, &[1], &mut [0u8; 5]).unwrap_err();
            assert_eq!(
                e,
                CommError::InvalidGroup(format!(
                    "rank {me} called all_gather on group {:?} without being a member",
                    other_node.ranks()
                ))
            );
            // Typed helpers report the byte lengths of the primitive they wrap.
            let e = comm.all_gather(&world, &[1u32], &mut [0u32; 3]).unwrap_err();
            assert_eq!(
                e,
                CommError::Mismatch("all_gather: receive buffer of 12 bytes for 4 chunks of 4 bytes".into())
            );
            let e = comm
                .all_to_all_v(&world, (&[1u16; 4], &[1, 1, 1, 1]), (&mut [0u16; 4], &[1, 1, 2]))
                .unwrap_err();
            assert_eq!(
                e,
                CommError::Mismatch("all_to_all_v: 4 send and 3 receive counts for a group of 4".into())
            );
            let e = comm.broadcast_bytes(&world, 4, &mut [0u8]).unwrap_err();
            assert_eq!(e, CommError::InvalidGroup("broadcast root index 4 in a group of 4".into()));
            let e = comm.reduce_scatter_f32(&world, &[0.0; 7], &mut [0.0; 2]).unwrap_err();
            assert_eq!(e, CommError::Mismatch("reduce_scatter: send of 7 elements for 4 chunks of 2".into()));
            // Rejected calls did not start a collective: the streams still line up.
            comm.barrier(&world)?;
            Ok(())
        })
        .unwrap();
}

/// The smallest possible backend: one rank, the `raw` hook only (what a new backend,
/// e.g. a GPU one, implements). It inherits the checks, their words and the
/// traffic accounting from the trait.
struct Loopback {
    topology: Topology,
    traffic: TrafficCounter,
    raw_calls: usize,
}

impl Loopback {
    fn new() -> Self {
        let topology = Topology::ranks(1).per_node(1).unwrap();
        Self { topology, traffic: TrafficCounter::new(topology, 0), raw_calls: 0 }
    }
}

impl Communicator for Loopback {
    fn traffic(&self) -> &TrafficCounter {
        &self.traffic
    }
    fn traffic_mut(&mut self) -> &mut TrafficCounter {
        &mut self.traffic
    }
    fn raw(&mut self, _: &Group, _: usize, call: RawCall<'_>) -> Result<(), CommError> {
        self.raw_calls += 1;
        match call {
            // Valid arguments: the lengths are equal in a group of one.
            RawCall::AllGather { send, recv }
            | RawCall::AllToAll { send, recv }
            | RawCall::AllToAllV { send, recv, .. } => recv.copy_from_slice(send),
            RawCall::ReduceScatter { send, recv } => {
                recv.iter_mut().zip(send).for_each(|(r, s)| *r = 0.0 + s)
            }
            RawCall::AllReduce { buf } => buf.iter_mut().for_each(|x| *x += 0.0),
            RawCall::Broadcast { .. } | RawCall::Barrier => {}
        }
        Ok(())
    }
    fn duplicate(&mut self) -> Result<Box<dyn Communicator>, CommError> {
        Ok(Box::new(Loopback::new()))
    }
}

#[test]
fn a_backend_with_only_raw_hooks_inherits_the_checks() {
    let mut lb = Loopback::new();
    let checks = check_argument_errors(&mut lb).unwrap();
    assert_eq!(
        checks,
        ThreadCluster::new(lb.topology, ThreadOptions::default()).run(check_argument_errors).unwrap()[0]
    );
    // Only the final, valid all_gather reached the raw hook.
    assert_eq!(lb.raw_calls, 1);
    assert_eq!(
        Primitive::ALL.map(Primitive::name).join(" "),
        "all_gather all_to_all all_to_all_v reduce_scatter all_reduce broadcast barrier"
    );
}
