//! Live control: the socket's permissions and peer check, the protocol's
//! refusals, and swaps seen by `status` and by the next decision, with a
//! driver thread allocating through the ranks' `SharedAllocator`s.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
#[cfg(feature = "wasm")]
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use wasmem::alloc::Allocator;
use wasmem::alloc::SharedAllocator;
use wasmem::builtin;
use wasmem::ctl::{
    current_uid, request, request_raw, ClientError, CtlServer, RankControl, Request, RoleArg, ServerOptions, Status,
    SwapOutcome,
};
use wasmem::device::sim::{SimConfig, SimDevice};
use wasmem::shadow::{Shadow, ShadowHandle};
use wasmem::trace::Event;
use wasmem::types::{StreamId, TensorKind, GIB, MIB};

const T: Duration = Duration::from_secs(30);

/// A fresh owner-only directory for one test.
fn dir(tag: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("ctl-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&d).unwrap();
    d
}

fn ranks(n: usize, policy: &str) -> Vec<SharedAllocator<SimDevice>> {
    (0..n)
        .map(|_| {
            SharedAllocator::new(Allocator::new(SimDevice::with_capacity(8 * GIB), builtin::by_name(policy).unwrap()))
        })
        .collect()
}

fn server(path: &Path, ranks: &[SharedAllocator<SimDevice>], opts: ServerOptions) -> CtlServer {
    let ctl = RankControl::new(ranks.to_vec(), common::loader());
    CtlServer::start(path, ctl.into_arc(), opts).unwrap()
}

fn status(path: &Path) -> Status {
    serde_json::from_value(request(path, &Request::Status, T).unwrap()).unwrap()
}

fn swap(path: &Path, role: RoleArg, policy: &str) -> Result<SwapOutcome, ClientError> {
    request(path, &Request::Swap { role, policy: policy.into() }, T).map(|v| serde_json::from_value(v).unwrap())
}

#[test]
fn socket_and_directory_are_owner_only_and_removed_at_drop() {
    let d = dir("perm");
    let sub = d.join("run");
    let path = sub.join("w.sock");
    let rs = ranks(1, "pytorch");
    let srv = server(&path, &rs, ServerOptions::default());
    let dm = std::fs::metadata(&sub).unwrap();
    assert_eq!(dm.permissions().mode() & 0o777, 0o700);
    let sm = std::fs::symlink_metadata(&path).unwrap();
    assert!(sm.file_type().is_socket());
    assert_eq!(sm.permissions().mode() & 0o777, 0o600);
    assert_eq!(status(&path).ranks.len(), 1);
    // A second server on the same live socket is refused.
    let e =
        CtlServer::start(&path, RankControl::new(rs.clone(), common::loader()).into_arc(), ServerOptions::default())
            .unwrap_err();
    assert!(e.to_string().contains("in use"), "{e}");
    drop(srv);
    assert!(!path.exists(), "socket left behind");
    assert!(!sub.exists(), "the directory the server created is left behind");
    // A stale socket (nobody listening) is replaced.
    std::fs::create_dir(&sub).unwrap();
    std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o700)).unwrap();
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let srv = server(&path, &rs, ServerOptions::default());
    assert_eq!(status(&path).ranks.len(), 1);
    drop(srv);
    assert!(sub.exists(), "a directory the server did not create is removed");
}

#[test]
fn an_open_directory_or_a_foreign_file_is_refused() {
    let d = dir("open");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    let rt = common::loader();
    let rs = ranks(1, "pytorch");
    let e = CtlServer::start(
        &d.join("w.sock"),
        RankControl::new(rs.clone(), rt.clone()).into_arc(),
        ServerOptions::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("mode 0755") && e.to_string().contains("owner-only"), "{e}");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(d.join("f.sock"), b"not a socket").unwrap();
    let e =
        CtlServer::start(&d.join("f.sock"), RankControl::new(rs, rt).into_arc(), ServerOptions::default()).unwrap_err();
    assert!(e.to_string().contains("not a socket"), "{e}");
    assert_eq!(std::fs::read(d.join("f.sock")).unwrap(), b"not a socket");
}

/// Sends `bytes` raw and returns (the reply line, whether the server then closed).
fn raw(path: &Path, bytes: &[u8]) -> (serde_json::Value, bool) {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let _ = s.write_all(bytes);
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    // Read to the end of the reply line, then see whether more follows or EOF.
    while !got.contains(&b'\n') {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed without a reply");
        got.extend_from_slice(&buf[..n]);
    }
    let nl = got.iter().position(|&b| b == b'\n').unwrap();
    let reply = serde_json::from_slice(&got[..nl]).unwrap();
    let closed = got.len() == nl + 1 && s.read(&mut buf).map(|n| n == 0).unwrap_or(true);
    (reply, closed)
}

#[test]
fn bad_requests_are_refused_by_name_and_the_connection_closed() {
    let d = dir("proto");
    let path = d.join("w.sock");
    let rs = ranks(1, "pytorch");
    let _srv = server(&path, &rs, ServerOptions::default());
    let big = [b"{\"cmd\":\"status\",\"pad\":\"".as_slice(), &vec![b'x'; 70 * 1024], b"\"}\n"].concat();
    let cases: [(&[u8], &str); 6] = [
        (b"{\"cmd\":\"status\"\n", "malformed request: not JSON"),
        (b"\xff\xfe\n", "malformed request: not JSON"),
        (b"[\"status\"]\n", "expected a JSON object"),
        (b"{\"cmd\":\"reboot\"}\n", "unknown command `reboot`"),
        (b"{\"cmd\":\"swap\",\"role\":\"placement\"}\n", "missing field `policy`"),
        (&big, "request too large: more than 65536 bytes"),
    ];
    for (bytes, want) in cases {
        let (reply, closed) = raw(&path, bytes);
        assert_eq!(reply["ok"], false, "{reply}");
        let e = reply["error"].as_str().unwrap();
        assert!(e.contains(want), "{e} (wanted {want})");
        assert!(closed, "connection left open after {want}");
    }
    // Two good requests on one connection are both answered; the server still serves.
    let reply = request_raw(&path, b"{\"cmd\":\"status\"}", T).unwrap();
    assert!(reply.ok, "{reply:?}");
    let mut s = UnixStream::connect(&path).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s.write_all(b"{\"cmd\":\"status\"}\n{\"cmd\":\"status\"}\n").unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut all = String::new();
    s.read_to_string(&mut all).unwrap();
    assert_eq!(all.lines().filter(|l| l.starts_with("{\"ok\":true")).count(), 2, "{all}");
    // A valid command that fails keeps the connection and names the policy.
    let e = swap(&path, RoleArg::All, "no-such-policy").unwrap_err().to_string();
    assert!(e.contains("no-such-policy"), "{e}");
}

#[test]
fn a_foreign_uid_is_refused() {
    let d = dir("uid");
    let path = d.join("w.sock");
    let rs = ranks(1, "pytorch");
    let other = current_uid().wrapping_add(1);
    let _srv = server(&path, &rs, ServerOptions { allowed_uid: other, ..ServerOptions::default() });
    let e = request(&path, &Request::Status, T).unwrap_err().to_string();
    assert!(e.contains(&format!("refused: peer uid {}", current_uid())) && e.contains(&format!("uid {other}")), "{e}");
    let e = swap(&path, RoleArg::Placement, "naive").unwrap_err().to_string();
    assert!(e.contains("refused"), "{e}");
    assert_eq!(rs[0].with(|a| a.policies().names()[0].clone()), "pytorch", "a refused peer changed a policy");
}

#[test]
fn a_silent_client_times_out_and_the_next_is_served() {
    let d = dir("slow");
    let path = d.join("w.sock");
    let rs = ranks(1, "pytorch");
    let opts = ServerOptions { request_timeout: Duration::from_millis(200), ..ServerOptions::default() };
    let _srv = server(&path, &rs, opts);
    // Half a request, then silence.
    let (reply, closed) = raw(&path, b"{\"cmd\":");
    assert!(reply["error"].as_str().unwrap().contains("timed out"), "{reply}");
    assert!(closed);
    assert_eq!(status(&path).ranks.len(), 1);
    // A client that closes without a newline still gets its one request answered.
    let r = request_raw(&path, b"{\"cmd\":\"status\"}", T).unwrap();
    assert!(r.ok, "{r:?}");
}

fn alloc_free(shared: &SharedAllocator<SimDevice>, bytes: u64) -> u64 {
    let before = shared.with(|a| a.gauges().reserved_bytes);
    let id = shared.alloc(bytes, TensorKind::Activation, StreamId(0)).unwrap();
    let after = shared.with(|a| a.gauges().reserved_bytes);
    shared.free(id).unwrap();
    after - before
}

#[test]
fn a_swap_shows_in_status_and_decides_the_next_allocation() {
    let d = dir("swap");
    let path = d.join("w.sock");
    let rs = ranks(2, "pytorch");
    let _srv = server(&path, &rs, ServerOptions::default());
    // A driver thread allocates on rank 1 throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let (r1, stop2, done2) = (rs[1].clone(), stop.clone(), done.clone());
    let driver = std::thread::spawn(move || {
        let mut n = 0u64;
        while !stop2.load(Ordering::SeqCst) || n < 1000 {
            let id = r1.alloc((n % 17 + 1) * 300_000, TensorKind::Temp, StreamId(0)).unwrap();
            r1.use_tensor(id, None).unwrap();
            r1.free(id).unwrap();
            n += 1;
            done2.store(n, Ordering::SeqCst);
        }
        n
    });
    // The swaps below happen while the driver is running.
    while done.load(Ordering::SeqCst) < 10 {
        std::thread::yield_now();
    }
    let st = status(&path);
    assert_eq!(st.ranks.len(), 2);
    assert_eq!(st.ranks[0].policies.placement, "pytorch");
    // Under pytorch a 1 MiB tensor takes a 2 MiB small-pool segment; once
    // cached, the same request reserves nothing more.
    assert_eq!(alloc_free(&rs[0], MIB), 2 * MIB);
    assert_eq!(alloc_free(&rs[0], MIB), 0);
    let o = swap(&path, RoleArg::Placement, "naive").unwrap();
    assert_eq!(
        (o.roles.clone(), o.old.clone(), o.new.clone(), o.ranks),
        (vec!["placement".into()], vec!["pytorch".into()], vec!["naive".into()], 2)
    );
    // The very next decision is naive's: its own pool, one exact-size segment.
    assert_eq!(alloc_free(&rs[0], MIB), MIB);
    let st = status(&path);
    for r in &st.ranks {
        assert_eq!(
            (r.policies.placement.as_str(), r.policies.reclamation.as_str(), r.policies.eviction.as_str()),
            ("naive", "pytorch", "lru"),
            "rank {}",
            r.rank
        );
    }
    assert!(st.ranks[1].counters.allocs > 0 && st.ranks[0].counters.allocs == 3, "{st:?}");
    assert_eq!(st.ranks[0].memory.capacity_bytes, 8 * GIB);
    // `all` with a built-in name replaces every role.
    let o = swap(&path, RoleArg::All, "lifecycle").unwrap();
    assert_eq!(o.roles, ["placement", "reclamation", "eviction"]);
    assert_eq!(status(&path).ranks[1].policies.placement, "lifecycle");
    stop.store(true, Ordering::SeqCst);
    let n = driver.join().unwrap();
    assert!(n >= 1000);
    for r in &rs {
        r.with(|a| a.check_invariants()).unwrap();
        assert_eq!(r.with(|a| a.live_tensors()), 0);
    }
    assert_eq!(status(&path).ranks[1].counters.allocs, n);
}

#[cfg(feature = "wasm")]
#[test]
fn webassembly_swaps_through_the_socket() {
    if !["lru-evict", "pytorch-like"].iter().all(|n| wasmem::policy::shipped_candidates(n).iter().any(|p| p.is_file()))
    {
        eprintln!("skipping: shipped policies not built (bash policies/build.sh)");
        return;
    }
    let d = dir("wasm");
    let path = d.join("w.sock");
    let rs = ranks(2, "pytorch");
    let _srv = server(&path, &rs, ServerOptions::default());
    // lru-evict provides eviction only: asking it for placement is refused, and nothing changes.
    let e = swap(&path, RoleArg::Placement, "lru-evict").unwrap_err().to_string();
    assert!(e.contains("does not provide the placement role"), "{e}");
    let o = swap(&path, RoleArg::All, "lru-evict").unwrap();
    assert_eq!(o.roles, ["eviction"]);
    let o = swap(&path, RoleArg::Placement, "pytorch-like").unwrap();
    assert_eq!(o.roles, ["placement"]);
    let st = status(&path);
    for (r, shared) in st.ranks.iter().zip(&rs) {
        assert_eq!(r.policies.placement, o.new[0]);
        assert_ne!(r.policies.eviction, "lru", "eviction not swapped on rank {}", r.rank);
        assert_eq!(r.policies.reclamation, "pytorch");
        // The WebAssembly placement decides the next allocation.
        let calls = shared.with(|a| a.policies().health(wasmem::decision::Role::Placement).calls);
        let id = shared.alloc(3 * MIB, TensorKind::Param, StreamId(0)).unwrap();
        shared.free(id).unwrap();
        assert_eq!(shared.with(|a| a.policies().health(wasmem::decision::Role::Placement).calls), calls + 1);
        assert_eq!(shared.with(|a| a.policies().health(wasmem::decision::Role::Placement).fallbacks), 0);
    }
    // Each rank has its own instance.
    let a = rs[0].state(wasmem::decision::Role::Placement).unwrap();
    let b = rs[1].state(wasmem::decision::Role::Placement).unwrap();
    assert_eq!(a.state_name(), b.state_name());
    assert_ne!(a.instance(), b.instance());
    // Swapping to the same WebAssembly policy carries its state.
    let o = swap(&path, RoleArg::Placement, "pytorch-like").unwrap();
    assert!(o.state_bytes.is_some(), "{o:?}");
}

#[test]
fn status_reports_the_tiers_when_enabled() {
    let d = dir("tiers");
    let path = d.join("w.sock");
    let rs = vec![SharedAllocator::new(Allocator::new(
        SimDevice::with_capacity(64 * MIB),
        builtin::by_name("pytorch").unwrap(),
    ))];
    rs[0].with(|a| a.enable_tiers(wasmem::tier::TierConfig::default()));
    let _srv = server(&path, &rs, ServerOptions::default());
    assert!(status(&path).ranks[0].tiers.is_some_and(|t| t.evictions == 0));
    // Twice the device: the first tensors go to the host tier.
    let ids: Vec<_> = (0..8).map(|_| rs[0].alloc(16 * MIB, TensorKind::Activation, StreamId(0)).unwrap()).collect();
    let st = status(&path);
    let t = st.ranks[0].tiers.unwrap();
    assert!(t.evictions > 0 && t.host_bytes >= 64 * MIB, "{t:?}");
    assert!(wasmem::ctl::render_status(&st).contains("tiers: host"), "{st:?}");
    for id in ids {
        rs[0].free(id).unwrap();
    }
    let plain = ranks(1, "pytorch");
    let d2 = dir("notiers");
    let _srv2 = server(&d2.join("w.sock"), &plain, ServerOptions::default());
    assert_eq!(status(&d2.join("w.sock")).ranks[0].tiers, None);
}

#[test]
fn status_reports_step_and_shadows() {
    let d = dir("shadow");
    let path = d.join("w.sock");
    let rs = ranks(1, "pytorch");
    let sh = ShadowHandle::new(Shadow::new("naive", builtin::by_name("naive").unwrap(), SimConfig::default()));
    let mut tap = sh.tap();
    tap(&Event::Alloc { id: 1, bytes: MIB, kind: TensorKind::Temp, stream: 0, t_us: None });
    tap(&Event::Free { id: 2, t_us: None });
    let ctl = RankControl::new(rs.clone(), common::loader())
        .with_shadow(0, sh)
        .with_status_hook(Box::new(|s: &mut Status| s.step = Some(41)));
    let _srv = CtlServer::start(&path, ctl.into_arc(), ServerOptions::default()).unwrap();
    let st = status(&path);
    assert_eq!(st.step, Some(41));
    assert_eq!(st.pid, std::process::id());
    assert_eq!(st.shadows.len(), 1);
    let s = &st.shadows[0];
    assert_eq!((s.label.as_str(), s.policies.placement.as_str(), s.events, s.errors), ("naive", "naive", 2, 1));
    assert_eq!(s.peak_reserved_bytes, MIB);
    let text = wasmem::ctl::render_status(&st);
    assert!(text.contains("step 41") && text.contains("shadow of rank 0 (naive"), "{text}");
}

#[cfg(feature = "wasm")]
fn wasmem(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_wasmem")).args(args).output().expect("run wasmem");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[cfg(feature = "wasm")]
#[test]
fn cli_ctl_swaps_and_reports() {
    let d = dir("cli");
    let path = d.join("w.sock");
    let p = path.to_str().unwrap();
    let rs = ranks(2, "pytorch");
    let _srv = server(&path, &rs, ServerOptions::default());
    let (code, out, err) = wasmem(&["ctl", "--socket", p, "swap", "reclamation", "lifecycle"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("reclamation: pytorch → lifecycle on 2 rank(s)"), "{out}");
    assert_eq!(rs[1].with(|a| a.policies().names()[1].clone()), "lifecycle");
    let (code, out, err) = wasmem(&["ctl", "status", "--socket", p]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("rank 1: placement=pytorch reclamation=lifecycle eviction=lru"), "{out}");
    assert!(out.contains("memory: live") && out.contains("counters:"), "{out}");
    let (code, out, err) = wasmem(&["ctl", "--socket", p, "status", "--json"]);
    assert_eq!(code, 0, "{err}");
    let st: Status = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(st.ranks[0].policies.reclamation, "lifecycle");
    let (code, _, err) = wasmem(&["ctl", "--socket", p, "swap", "everything", "naive"]);
    assert_ne!(code, 0);
    assert!(err.contains("unknown role `everything`"), "{err}");
    let (code, _, err) = wasmem(&["ctl", "--socket", p, "swap", "all", "no-such-policy"]);
    assert_eq!(code, 1);
    assert!(err.contains("cannot load policy `no-such-policy`"), "{err}");
    let missing = d.join("none.sock");
    let (code, _, err) = wasmem(&["ctl", "--socket", missing.to_str().unwrap(), "status"]);
    assert_eq!(code, 1);
    assert!(err.contains("cannot connect to the control socket") && err.contains("none.sock"), "{err}");
}

#[cfg(feature = "wasm")]
#[test]
fn cli_ctl_finds_the_live_sockets_of_the_default_directory() {
    let xdg = dir("xdg");
    let run = xdg.join("wasmem");
    let ctl = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_wasmem"))
            .args(args)
            .env("XDG_RUNTIME_DIR", &xdg)
            .output()
            .expect("run wasmem");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, _, err) = ctl(&["ctl", "status"]);
    assert_eq!(code, 1);
    assert!(err.contains("no running wasmem found") && err.contains("--socket"), "{err}");
    // A socket left by a killed process is skipped.
    std::fs::DirBuilder::new().mode(0o700).create(&run).unwrap();
    drop(std::os::unix::net::UnixListener::bind(run.join("050.sock")).unwrap());
    let (code, _, err) = ctl(&["ctl", "status"]);
    assert_eq!(code, 1);
    assert!(err.contains("nobody listens on") && err.contains("050.sock"), "{err}");
    let rs = ranks(1, "lifecycle");
    let first = server(&run.join("100.sock"), &rs, ServerOptions::default());
    let (code, out, err) = ctl(&["ctl", "status"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("rank 0: placement=lifecycle"), "{out}");
    let second = server(&run.join("200.sock"), &ranks(1, "naive"), ServerOptions::default());
    // Several processes (the ranks of a PyTorch job): every live one is listed.
    let (code, out, err) = ctl(&["ctl", "status"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("100.sock ==") && out.contains("200.sock =="), "{out}");
    assert!(out.contains("placement=lifecycle") && out.contains("placement=naive"), "{out}");
    assert!(!out.contains("050.sock"), "{out}");
    let (code, out, err) = ctl(&["ctl", "status", "--json"]);
    assert_eq!(code, 0, "{err}");
    let all: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(all.as_array().map(Vec::len), Some(2), "{out}");
    let (code, _, err) = ctl(&["ctl", "--rank", "5", "status"]);
    assert_eq!(code, 1);
    assert!(err.contains("no running wasmem process has rank 5"), "{err}");
    drop(first);
    let (code, out, err) = ctl(&["ctl", "swap", "all", "pytorch"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("placement: naive → pytorch on 1 rank(s)"), "{out}");
    drop(second);
}

#[cfg(feature = "wasm")]
/// `wasmem ctl ARGS` run as the user `nobody` (needs root and `setpriv`).
fn as_nobody(args: &[&str]) -> Option<(i32, String)> {
    if current_uid() != 0 || !Path::new("/usr/bin/setpriv").exists() {
        eprintln!("skipping: running as another user needs root and setpriv");
        return None;
    }
    let out = Command::new("/usr/bin/setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", env!("CARGO_BIN_EXE_wasmem"), "ctl"])
        .args(args)
        .output()
        .expect("run setpriv");
    Some((out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned()))
}

#[cfg(feature = "wasm")]
#[test]
fn a_real_other_user_is_kept_out_twice() {
    let d = dir("nobody");
    let path = d.join("w.sock");
    let p = path.to_str().unwrap();
    let rs = ranks(1, "pytorch");
    let _srv = server(&path, &rs, ServerOptions::default());
    // The directory keeps other users from the socket.
    let Some((code, err)) = as_nobody(&["--socket", p, "status"]) else { return };
    assert_eq!(code, 1);
    assert!(err.contains("Permission denied"), "{err}");
    // With the filesystem opened up behind the server's back, the peer
    // check still refuses them, and nothing changes.
    for (f, mode) in [(&d, 0o711), (&path, 0o666)] {
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let (code, err) = as_nobody(&["--socket", p, "swap", "all", "naive"]).unwrap();
    assert_eq!(code, 1);
    assert!(err.contains("refused: peer uid 65534 is not the owner of this process (uid 0)"), "{err}");
    assert_eq!(rs[0].with(|a| a.policies().names()[0].clone()), "pytorch");
    assert_eq!(status(&path).ranks[0].policies.placement, "pytorch");
}

#[test]
fn random_bytes_over_the_socket_get_replies_and_the_server_lives_on() {
    let d = dir("fuzz");
    let path = d.join("w.sock");
    let rs = ranks(1, "pytorch");
    let opts = ServerOptions { max_request_bytes: 512, ..ServerOptions::default() };
    let _srv = server(&path, &rs, opts);
    let seeds: [&[u8]; 4] =
        [b"{\"cmd\":\"status\"}", b"{\"cmd\":\"swap\",\"role\":\"eviction\",\"policy\":\"lru\"}", b"{\"cmd\":\"", b""];
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let (mut ok, mut refused) = (0, 0);
    for i in 0..300 {
        let mut msg = seeds[i % seeds.len()].to_vec();
        for _ in 0..next() % 6 {
            let pos = (next() as usize) % (msg.len() + 1);
            msg.insert(pos, next() as u8);
        }
        if i % 7 == 0 {
            msg.extend(std::iter::repeat_n(b'x', 600)); // past the limit
        }
        let mut s = UnixStream::connect(&path).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        let _ = s.write_all(&msg);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        // Every line the server sends is a reply.
        for line in out.lines() {
            let r: wasmem::ctl::Reply = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
            if r.ok {
                ok += 1;
            } else {
                refused += 1;
                assert!(!r.error.unwrap().is_empty());
            }
        }
    }
    assert!(ok > 0 && refused > 0, "{ok} answered, {refused} refused");
    assert_eq!(status(&path).ranks.len(), 1);
    rs[0].with(|a| a.check_invariants()).unwrap();
}
