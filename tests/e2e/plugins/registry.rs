//! Plugins through a real OCI registry (the CNCF distribution server, Debian's `docker-registry`, started
//! on loopback by the test): push, pull by tag and by digest, a tampered layer refused, and a pulled,
//! approved plugin serving a call.

use serde_json::{Value, json};
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// A registry on a free loopback port, killed when dropped.
struct Registry {
    child: Child,
    port: u16,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the registry storing under `dir`, or `None` (skipped with a note) where it is not installed
/// and `THORN_REQUIRE_REGISTRY` is not 1.
fn registry(dir: &Path) -> Option<Registry> {
    let bin = ["docker-registry", "registry"].into_iter().find(|b| {
        Command::new("sh")
            .args(["-c", &format!("command -v {b}")])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    let Some(bin) = bin else {
        assert!(
            std::env::var_os("THORN_REQUIRE_REGISTRY").is_none_or(|v| v != "1"),
            "THORN_REQUIRE_REGISTRY=1 but no registry is installed (Debian: apt-get install docker-registry)"
        );
        eprintln!("skip: the registry test (no docker-registry: apt-get install docker-registry)");
        return None;
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = dir.join("registry.yml");
    std::fs::write(
        &config,
        format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
            dir.join("storage").display()
        ),
    )
    .unwrap();
    let child = Command::new(bin)
        .arg("serve")
        .arg(&config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let r = Registry { child, port };
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the registry did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(r)
}

/// Borrowed, as `Command` takes them.
fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn thorn(args: &[&str], place: &[&str]) -> (bool, String) {
    let out = Command::new(thorn_tests::thorn_binary())
        .arg("plugins")
        .args(args)
        .args(place)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn plugins_go_through_a_registry_by_tag_and_digest_and_a_tampered_layer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let Some(reg) = registry(dir.path()) else {
        return;
    };
    let wasm = thorn_tests::plugin_wasm("calculator");
    let tag = format!("oci://127.0.0.1:{}/tools/calculator:1.0", reg.port);
    let (ok, out) = thorn(&["push", wasm.to_str().unwrap(), &tag], &[]);
    assert!(ok, "{out}");
    let by_digest = out.lines().last().unwrap().trim().to_owned();
    assert!(
        by_digest.starts_with(&format!(
            "oci://127.0.0.1:{}/tools/calculator@sha256:",
            reg.port
        )),
        "{out}"
    );
    let sha = thorn_tests::sha256_hex(&std::fs::read(&wasm).unwrap());

    let (tagged, pinned) = (place(dir.path(), "a", &[]), place(dir.path(), "b", &[]));
    for (reference, at) in [(&tag, &tagged), (&by_digest, &pinned)] {
        let (ok, out) = thorn(&["pull", reference, "--approve"], &args(at));
        assert!(ok, "{reference}: {out}");
        // The component installed and pinned is the one pushed, byte for byte.
        let installed = Path::new(&at[1]).join("calculator.wasm");
        assert_eq!(
            thorn_tests::sha256_hex(&std::fs::read(installed).unwrap()),
            sha
        );
        let policy: Value =
            serde_json::from_str(&std::fs::read_to_string(&at[3]).unwrap()).unwrap();
        assert_eq!(policy["plugins"]["calculator"]["sha256"], sha, "{policy}");
    }
    // A digest the registry does not have is refused.
    let missing = format!(
        "oci://127.0.0.1:{}/tools/calculator@sha256:{}",
        reg.port,
        "0".repeat(64)
    );
    let (ok, out) = thorn(&["pull", &missing], &args(&place(dir.path(), "c", &[])));
    assert!(!ok, "{out}");

    // The pulled, approved plugin serves a call.
    serves_a_call(&tagged);

    // A layer changed in the registry's storage: the pull is refused on its digest, nothing installed.
    let blob = dir
        .path()
        .join("storage/docker/registry/v2/blobs/sha256")
        .join(&sha[..2])
        .join(&sha)
        .join("data");
    let mut bytes = std::fs::read(&blob).unwrap();
    bytes[100] ^= 0xff;
    std::fs::write(&blob, bytes).unwrap();
    let fresh = place(dir.path(), "d", &[]);
    let (ok, out) = thorn(&["pull", &tag, "--approve"], &args(&fresh));
    assert!(!ok, "{out}");
    assert!(out.to_lowercase().contains("digest"), "{out}");
    assert!(!Path::new(&fresh[1]).join("calculator.wasm").exists());
}

/// An ECDSA P-256 key pair made by openssl as an operator would: (private key file, public key PEM).
fn keypair(dir: &Path, name: &str) -> (std::path::PathBuf, String) {
    let key = dir.join(format!("{name}.pem"));
    let ok = Command::new("openssl")
        .args(["ecparam", "-name", "prime256v1", "-genkey", "-out"])
        .arg(&key)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "openssl ecparam");
    let out = Command::new("openssl")
        .args(["ec", "-pubout", "-in"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(out.status.success());
    (key, String::from_utf8(out.stdout).unwrap())
}

#[test]
fn a_policy_with_keys_installs_only_what_they_signed_for_the_digest_pulled() {
    let dir = tempfile::tempdir().unwrap();
    let Some(reg) = registry(dir.path()) else {
        return;
    };
    let (key, public) = keypair(dir.path(), "publisher");
    let (_, stranger) = keypair(dir.path(), "stranger");
    let repo = format!("oci://127.0.0.1:{}/tools/calculator", reg.port);
    // A push or sign that must work: its output.
    let ok = |a: &[&str]| {
        let (ok, out) = thorn(a, &[]);
        assert!(ok, "{a:?}: {out}");
        out
    };
    // A pull into a place trusting `keys` that must be refused with `why`, installing nothing.
    let refused = |tag: &str, name: &str, keys: &[&str], why: &str| {
        let at = place(dir.path(), name, keys);
        let (ok, out) = thorn(&["pull", &format!("{repo}:{tag}"), "--approve"], &args(&at));
        assert!(!ok && out.contains(why), "{tag} ({name}): {out}");
        assert!(
            !Path::new(&at[1]).join("calculator.wasm").exists(),
            "{name}"
        );
        assert!(!Path::new(&at[1]).join("units.wasm").exists(), "{name}");
    };
    let (calculator, units) = (
        thorn_tests::plugin_wasm("calculator"),
        thorn_tests::plugin_wasm("units"),
    );
    ok(&["push", calculator.to_str().unwrap(), &format!("{repo}:1.0")]);
    ok(&[
        "sign",
        &format!("{repo}:1.0"),
        "--key",
        key.to_str().unwrap(),
    ]);

    let trusting = place(dir.path(), "ok", &[&public]);
    let (pulled, out) = thorn(
        &["pull", &format!("{repo}:1.0"), "--approve"],
        &args(&trusting),
    );
    assert!(pulled && out.contains("signature verified"), "{out}");
    // The signed, approved, pinned plugin serves a call.
    serves_a_call(&trusting);

    // The wrong key.
    refused("1.0", "wrong", &[&stranger], "no signature verifies");
    // Unsigned: another artifact under another tag.
    ok(&["push", units.to_str().unwrap(), &format!("{repo}:units")]);
    refused("units", "unsigned", &[&public], "not signed");
    // Re-tagged: other bytes pushed under the signed tag. The old signature names the old digest; the
    // new manifest has none, so the tag no longer installs.
    ok(&["push", units.to_str().unwrap(), &format!("{repo}:1.0")]);
    refused("1.0", "retagged", &[&public], "not signed");

    // A signature for another digest: the old signature copied to the new manifest's signature tag
    // (what an attacker with push rights but no key can do) names the old digest and is refused.
    let out = ok(&["push", units.to_str().unwrap(), &format!("{repo}:copy")]);
    let new_digest = out.lines().last().unwrap().rsplit('@').next().unwrap();
    let tags = dir
        .path()
        .join("storage/docker/registry/v2/repositories/tools/calculator/_manifests/tags");
    let old_sig = std::fs::read_dir(&tags)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .find(|t| t.to_string_lossy().ends_with(".sig"))
        .expect("the signature's tag");
    copy_dir(
        &tags.join(old_sig),
        &tags.join(format!("{}.sig", new_digest.replace(':', "-"))),
    );
    refused("copy", "copied", &[&public], "its signatures name");

    // A policy key that is not a key is an error naming it.
    let bad = "-----BEGIN PUBLIC KEY-----\nnope\n-----END PUBLIC KEY-----";
    refused("1.0", "badkey", &[bad], "trust.keys[0]");
}

#[test]
fn keyless_bundles_attached_as_referrers_are_verified_at_pull_and_again_at_approve() {
    use thorn_tests::sigstore::{Signing, TestSigstore};
    let dir = tempfile::tempdir().unwrap();
    let Some(reg) = registry(dir.path()) else {
        return;
    };
    let issuer = "https://token.actions.githubusercontent.com";
    let release = "https://github.com/acme/tools/.github/workflows/release.yml@refs/tags/v1.0.0";
    let repo = format!("oci://127.0.0.1:{}/tools/calculator", reg.port);
    let ok = |a: &[&str], at: &[String]| {
        let (ok, out) = thorn(a, &args(at));
        assert!(ok, "{a:?}: {out}");
        out
    };
    let calculator = thorn_tests::plugin_wasm("calculator");
    let out = ok(
        &["push", calculator.to_str().unwrap(), &format!("{repo}:1.0")],
        &[],
    );
    let digest = out
        .lines()
        .last()
        .unwrap()
        .rsplit('@')
        .next()
        .unwrap()
        .to_owned();
    let mut sigstore = TestSigstore::new();
    let hex = digest.strip_prefix("sha256:").unwrap();
    let bytes: Vec<u8> = (0..32)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let bundle = sigstore.bundle(&bytes.try_into().unwrap(), &Signing::by(issuer, release));
    let file = dir.path().join("calculator.sigstore.json");
    std::fs::write(&file, bundle).unwrap();
    ok(
        &[
            "attach",
            &format!("{repo}:1.0"),
            "--bundle",
            file.to_str().unwrap(),
        ],
        &[],
    );
    // Pinned: this sigstore's root, and who may sign.
    let trusting = |name: &str, subject: &str| {
        let at = place_trusting(
            dir.path(),
            name,
            json!({"identities": [{"issuer": issuer, "subject": subject}],
                "trusted_root": "trusted_root.json"}),
        );
        std::fs::write(
            Path::new(&at[3])
                .parent()
                .unwrap()
                .join("trusted_root.json"),
            sigstore.trusted_root(),
        )
        .unwrap();
        at
    };
    let good = trusting("good", release);
    let out = ok(&["pull", &format!("{repo}:1.0"), "--approve"], &good);
    assert!(
        out.contains("signature verified") && out.contains(release),
        "{out}"
    );
    // By digest too; the record of the pull sits beside the plugin.
    let by_digest = trusting("digest", release);
    ok(
        &["pull", &format!("{repo}@{digest}"), "--approve"],
        &by_digest,
    );
    let record = Path::new(&by_digest[1]).join("calculator.provenance.json");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&record).unwrap()).unwrap();
    assert_eq!(r["manifest_digest"], digest.as_str(), "{r}");
    assert_eq!(r["evidence"]["bundles"].as_array().unwrap().len(), 1, "{r}");

    // Another identity trusted: refused, nothing installed.
    let other = trusting(
        "other",
        "https://github.com/acme/tools/.github/workflows/ci.yml@refs/heads/main",
    );
    let (pulled, out) = thorn(
        &["pull", &format!("{repo}:1.0"), "--approve"],
        &args(&other),
    );
    assert!(
        !pulled && out.contains("not an identity the policy trusts"),
        "{out}"
    );
    assert!(!Path::new(&other[1]).join("calculator.wasm").exists());

    // Pulled without approval, then the policy's trust changes before approval: approve checks again.
    let later = trusting("later", release);
    ok(&["pull", &format!("{repo}:1.0")], &later);
    let policy_file = Path::new(&later[3]).to_owned();
    let trusted = std::fs::read_to_string(&policy_file).unwrap();
    std::fs::write(
        &policy_file,
        trusted.replace(
            "release.yml@refs/tags/v1.0.0",
            "release.yml@refs/tags/v2.0.0",
        ),
    )
    .unwrap();
    let (approved, out) = thorn(&["approve", "calculator"], &args(&later));
    assert!(
        !approved && out.contains("not an identity the policy trusts"),
        "{out}"
    );
    let policy: Value =
        serde_json::from_str(&std::fs::read_to_string(&policy_file).unwrap()).unwrap();
    assert!(policy["plugins"]["calculator"].is_null(), "{policy}");
    std::fs::write(&policy_file, &trusted).unwrap();
    let out = ok(&["approve", "calculator"], &later);
    assert!(
        out.contains("signature verified") && out.contains("approved calculator"),
        "{out}"
    );
    // The installed file swapped for other bytes: not the layer the record names.
    let units = thorn_tests::plugin_wasm("units");
    std::fs::copy(&units, Path::new(&later[1]).join("calculator.wasm")).unwrap();
    let (approved, out) = thorn(&["approve", "calculator"], &args(&later));
    assert!(!approved && out.contains("is not the layer of"), "{out}");

    // Credentials from the docker config's credential helper (the helper protocol: the registry on
    // stdin, JSON on stdout).
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let asked = dir.path().join("asked");
    let helper = bin.join("docker-credential-thorntest");
    std::fs::write(
        &helper,
        format!(
            "#!/bin/sh\n[ \"$1\" = get ] || exit 1\ncat > {}\necho '{{\"Username\": \"ci\", \"Secret\": \"s3cret\"}}'\n",
            asked.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&helper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let config = dir.path().join("docker");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(
        config.join("config.json"),
        json!({"credHelpers": {format!("127.0.0.1:{}", reg.port): "thorntest"}}).to_string(),
    )
    .unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let fresh = trusting("helper", release);
    let out = Command::new(thorn_tests::thorn_binary())
        .args(["plugins", "pull", &format!("{repo}:1.0")])
        .args(args(&fresh))
        .env("DOCKER_CONFIG", &config)
        .env("PATH", path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        std::fs::read_to_string(&asked).unwrap(),
        format!("127.0.0.1:{}", reg.port)
    );

    // Attaching what is not a bundle is refused before anything is pushed.
    let junk = dir.path().join("junk.json");
    std::fs::write(&junk, r#"{"mediaType": "text/plain"}"#).unwrap();
    let (attached, out) = thorn(
        &[
            "attach",
            &format!("{repo}:1.0"),
            "--bundle",
            junk.to_str().unwrap(),
        ],
        &[],
    );
    assert!(!attached && out.contains("not a sigstore bundle"), "{out}");
}

/// `thorn serve` over the plugins and policy of `place` answers a calculator call.
fn serves_a_call(place: &[String]) {
    let s = thorn_tests::ServeProcess::start(&args(place));
    let v = thorn_tests::forced_host_call(s.addr, "thorn:calculator", "What is 6 * 7?");
    assert!(
        v["thorn_host_tool_calls"][0]["result"]["value"].is_number(),
        "{v}"
    );
}

/// A plugin directory and policy under `dir/name` whose policy trusts `keys` (none: no signature
/// checked): the `--plugins` and `--policy` arguments.
fn place(dir: &Path, name: &str, keys: &[&str]) -> Vec<String> {
    place_trusting(dir, name, json!({ "keys": keys }))
}

/// A plugin directory and policy under `dir/name` whose policy's `trust` is `trust`.
fn place_trusting(dir: &Path, name: &str, trust: Value) -> Vec<String> {
    let p = dir.join(name);
    std::fs::create_dir_all(&p).unwrap();
    std::fs::write(p.join("policy.json"), json!({ "trust": trust }).to_string()).unwrap();
    vec![
        "--plugins".to_owned(),
        p.join("plugins").display().to_string(),
        "--policy".to_owned(),
        p.join("policy.json").display().to_string(),
    ]
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}
