//! Compiles every module of the kernel catalog as C++ (after `sim/cuda_sim.hpp`) with the simulator's
//! launcher, and a lookup from (module, kernel) names to a function that calls the kernel with
//! cuLaunchKernel-style parameters.

use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let sim = manifest.join("sim");
    println!("cargo:rerun-if-changed=sim");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .include(&sim)
        .opt_level(2)
        .warnings(true)
        .flag_if_supported("-Wno-unused-function")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-unknown-pragmas")
        // Each float operation rounded as written (a GPU kernel asks for fused multiply-adds explicitly).
        .flag_if_supported("-ffp-contract=off")
        .file(sim.join("runtime.cpp"));
    let mut find = String::from("#include \"cuda_sim.hpp\"\n");
    let mut arms = String::new();
    for m in thorn_kernels::ALL {
        let mut unit = format!(
            "#include \"cuda_sim.hpp\"\n#line 1 \"{}.cu\"\n{}\n",
            m.name, m.source
        );
        writeln!(
            unit,
            "extern \"C\" thorn_sim::Entry thorn_sim_find_{}(const char* k, int* arity) {{",
            m.name
        )
        .unwrap();
        for k in m.kernels {
            writeln!(
                unit,
                "    if (strcmp(k, \"{k}\") == 0) {{ *arity = thorn_sim::arity(&{k}); return [](void** p) {{ thorn_sim::call(&{k}, p); }}; }}"
            )
            .unwrap();
        }
        unit.push_str("    return nullptr;\n}\n");
        let path = out.join(format!("module_{}.cpp", m.name));
        std::fs::write(&path, unit).expect("write a generated source");
        build.file(&path);
        writeln!(
            find,
            "extern \"C\" thorn_sim::Entry thorn_sim_find_{}(const char*, int*);",
            m.name
        )
        .unwrap();
        writeln!(
            arms,
            "    if (strcmp(module, \"{0}\") == 0) return thorn_sim_find_{0}(kernel, arity);",
            m.name
        )
        .unwrap();
    }
    write!(
        find,
        "extern \"C\" thorn_sim::Entry thorn_sim_find(const char* module, const char* kernel, int* arity) {{\n{arms}    return nullptr;\n}}\n"
    )
    .unwrap();
    let path = out.join("find.cpp");
    std::fs::write(&path, find).expect("write a generated source");
    build.file(&path);
    build.compile("thorn_kernel_sim");
    // The sources are the kernels crate's; rebuild when they change.
    println!("cargo:rerun-if-changed=../kernels/cuda");
}
