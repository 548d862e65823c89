//! MPI point-to-point bandwidth probe: run under `mpirun` (`cargo xtask cluster probe`).
//!
//! `mpi_bandwidth [BYTES] [REPS] [bidi]`: rank 0 streams `REPS` messages of `BYTES` bytes
//! to the last rank with plain `MPI_Send`/`MPI_Recv` (one warm-up message first), the
//! last rank answers with one byte once it has them all, and rank 0 prints
//! `bandwidth_bytes_per_s=<achieved>` and the time. With `bidi`, the two ranks exchange
//! the messages both ways at once (`MPI_Sendrecv`) and the figure is per direction. Ranks in between only wait at the
//! final barrier. With one rank per node, the two ranks sit on different nodes, so the
//! figure is the node-to-node bandwidth through MPI (TCP under `cargo xtask cluster`).

use std::time::Instant;

use mpi::traits::{Communicator, CommunicatorCollectives, Destination, Source};

fn main() {
    let mut args = std::env::args().skip(1);
    let bytes: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(4 << 20);
    let reps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(8);
    let Some(universe) = mpi::initialize() else {
        eprintln!("mpi_bandwidth: MPI could not be initialised");
        std::process::exit(2);
    };
    let world = universe.world();
    let me = world.rank();
    let peer = world.size() - 1;
    if peer == 0 {
        eprintln!("mpi_bandwidth: needs at least 2 ranks");
        std::process::exit(2);
    }
    let mut buf = vec![0u8; bytes];
    let mut ack = [0u8; 1];
    let bidi = args.next().is_some_and(|a| a == "bidi");
    if bidi && (me == 0 || me == peer) {
        let other = world.process_at_rank(if me == 0 { peer } else { 0 });
        let out = vec![1u8; bytes];
        mpi::point_to_point::send_receive_into(&out[..], &other, &mut buf[..], &other);
        let start = Instant::now();
        for _ in 0..reps {
            mpi::point_to_point::send_receive_into(&out[..], &other, &mut buf[..], &other);
        }
        let secs = start.elapsed().as_secs_f64();
        if me == 0 {
            let rate = (bytes * reps) as f64 / secs;
            println!(
                "mpi_bandwidth: {reps} x {bytes} bytes each way between rank 0 and rank {peer} in \
                 {secs:.3} s: bandwidth_bytes_per_s={rate:.0}"
            );
        }
    } else if bidi {
    } else if me == 0 {
        world.process_at_rank(peer).send(&buf[..]);
        world.process_at_rank(peer).receive_into(&mut ack[..]);
        let start = Instant::now();
        for _ in 0..reps {
            world.process_at_rank(peer).send(&buf[..]);
        }
        world.process_at_rank(peer).receive_into(&mut ack[..]);
        let secs = start.elapsed().as_secs_f64();
        let rate = (bytes * reps) as f64 / secs;
        println!(
            "mpi_bandwidth: {reps} x {bytes} bytes from rank 0 to rank {peer} in {secs:.3} s: \
             bandwidth_bytes_per_s={rate:.0}"
        );
    } else if me == peer {
        world.process_at_rank(0).receive_into(&mut buf[..]);
        world.process_at_rank(0).send(&ack[..]);
        for _ in 0..reps {
            world.process_at_rank(0).receive_into(&mut buf[..]);
        }
        world.process_at_rank(0).send(&ack[..]);
    }
    world.barrier();
}
