//! Prints the CPU kernels' instruction set this machine gets (`THORN_ISA` caps it), then every one it can
//! run, best first: `scripts/test-aarch64` checks the run-time detection with it on several emulated CPUs.

use thorn_engine::backend::cpu::Isa;

fn main() {
    println!("{}", Isa::detect().name());
    let all: Vec<&str> = Isa::available().into_iter().map(Isa::name).collect();
    println!("{}", all.join(" "));
}
