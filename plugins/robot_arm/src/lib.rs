//! A robot-arm actuator simulator, the shape of a plugin that fronts real hardware: a 4-joint arm (base yaw,
//! shoulder, elbow, wrist pitch) and a gripper. The joint limits are in the schema, so a constrained model
//! cannot even write an out-of-range move and the host rejects one before the plugin runs; the plugin checks
//! them again (never trust the caller with hardware) and also refuses poses that would drive the tool into
//! the table. The pose persists in `/state` (read-write), as a real arm keeps its pose between calls.
//!
//! Moves are simulated as done when the call returns; a **jog** (one joint at a constant speed for a
//! time, a teach pendant's hold-to-move) really takes its time: the call lasts as long as the motion, the
//! motion is in the state file while it runs (so `arm_state` from another call sees the arm moving), and
//! the manifest declares it a deadman motion stopped by `arm_stop`. A stop that arrives mid-jog freezes
//! the joint where the clock says it is and counts the motion as interrupted.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use thorn_plugin_sdk::{Plugin, json};

/// Where the granted state directory appears inside the sandbox.
pub const STATE: &str = "/state/arm.json";

/// Link lengths in metres: base height, upper arm, forearm, wrist to tool tip.
const LINKS: [f64; 4] = [0.10, 0.25, 0.20, 0.08];
/// Joint limits in degrees, in the order base, shoulder, elbow, wrist.
pub const LIMITS: [(&str, f64, f64); 4] = [
    ("base", -170.0, 170.0),
    ("shoulder", -90.0, 90.0),
    ("elbow", 0.0, 150.0),
    ("wrist", -120.0, 120.0),
];
/// Slowest joint speed in degrees per second at speed 100%.
const MAX_SPEED: f64 = 90.0;

/// A move: absolute joint targets in degrees; joints left out stay where they are.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Move {
    /// Base yaw, degrees.
    #[schemars(range(min = -170.0, max = 170.0))]
    pub base: Option<f64>,
    /// Shoulder pitch from vertical, degrees (positive leans forward).
    #[schemars(range(min = -90.0, max = 90.0))]
    pub shoulder: Option<f64>,
    /// Elbow bend relative to the upper arm, degrees.
    #[schemars(range(min = 0.0, max = 150.0))]
    pub elbow: Option<f64>,
    /// Wrist pitch relative to the forearm, degrees.
    #[schemars(range(min = -120.0, max = 120.0))]
    pub wrist: Option<f64>,
    /// Gripper opening, percent (0 closed, 100 open).
    #[schemars(range(min = 0.0, max = 100.0))]
    pub gripper: Option<f64>,
    /// Speed, percent of the maximum.
    #[schemars(range(min = 1.0, max = 100.0))]
    pub speed: Option<f64>,
}

/// A joint, by name.
#[derive(Deserialize, JsonSchema, Clone, Copy)]
#[serde(rename_all = "lowercase")]
pub enum Joint {
    /// Base yaw.
    Base,
    /// Shoulder pitch.
    Shoulder,
    /// Elbow bend.
    Elbow,
    /// Wrist pitch.
    Wrist,
}

/// A jog: one joint turning at a constant speed for a time.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Jog {
    /// Which joint.
    pub joint: Joint,
    /// Degrees per second; negative turns the other way.
    #[schemars(range(min = -90.0, max = 90.0))]
    pub velocity: f64,
    /// How long, in milliseconds.
    #[schemars(range(min = 1, max = 10000))]
    pub duration_ms: u64,
}

/// The longest a jog may last, in milliseconds (its deadman is a little longer).
pub const MAX_JOG_MS: u64 = 10_000;

/// A jog in progress, as the state file records it.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
pub struct Motion {
    /// The joint's index (base, shoulder, elbow, wrist).
    pub joint: usize,
    /// Its angle when the jog began, degrees.
    pub from: f64,
    /// Degrees per second.
    pub velocity: f64,
    /// When it began, milliseconds since the Unix epoch.
    pub start_ms: u64,
    /// How long it lasts.
    pub duration_ms: u64,
}

impl Motion {
    /// The joint's angle at `now_ms` (it stays at the end once the time is up).
    pub fn at(&self, now_ms: u64) -> f64 {
        let t = now_ms.saturating_sub(self.start_ms).min(self.duration_ms);
        self.from + self.velocity * t as f64 / 1000.0
    }

    /// Whether it has run its time at `now_ms`.
    pub fn done(&self, now_ms: u64) -> bool {
        now_ms >= self.start_ms + self.duration_ms
    }
}

/// No arguments.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Nothing {}

/// Where the arm is.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
pub struct Pose {
    /// Joint angles in degrees: base, shoulder, elbow, wrist.
    pub joints: [f64; 4],
    /// Gripper opening, percent.
    pub gripper: f64,
    /// Stops commanded so far (the simulator's record that a stop reached the arm).
    #[serde(default)]
    pub stops: u64,
    /// A jog in progress (or one nobody ended: it ran its course).
    #[serde(default)]
    pub motion: Option<Motion>,
    /// Jogs a stop cut short.
    #[serde(default)]
    pub interrupted: u64,
}

impl Default for Pose {
    fn default() -> Self {
        Pose {
            joints: [0.0, 0.0, 90.0, 0.0],
            gripper: 100.0,
            stops: 0,
            motion: None,
            interrupted: 0,
        }
    }
}

/// What the arm reports after every call.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Status {
    /// Joint angles in degrees.
    pub base: f64,
    /// See `base`.
    pub shoulder: f64,
    /// See `base`.
    pub elbow: f64,
    /// See `base`.
    pub wrist: f64,
    /// Gripper opening, percent.
    pub gripper: f64,
    /// Tool tip position in metres, base frame (x forward, z up).
    pub tool: [f64; 3],
    /// Simulated time the last motion took, seconds.
    pub motion_seconds: f64,
    /// Stops commanded so far.
    pub stops: u64,
    /// Whether a jog is moving the arm now.
    pub moving: bool,
    /// Jogs a stop cut short.
    pub interrupted: u64,
}

fn round(x: f64, digits: i32) -> f64 {
    let s = 10f64.powi(digits);
    (x * s).round() / s
}

/// Forward kinematics: the tool tip for a pose, and the lowest point of the elbow, wrist and tip.
pub fn tool_position(j: &[f64; 4]) -> ([f64; 3], f64) {
    let rad = |d: f64| d.to_radians();
    let (t1, t2) = (rad(j[1]), rad(j[1] + j[2]));
    let t3 = rad(j[1] + j[2] + j[3]);
    let elbow = (LINKS[1] * t1.sin(), LINKS[0] + LINKS[1] * t1.cos());
    let wrist = (elbow.0 + LINKS[2] * t2.sin(), elbow.1 + LINKS[2] * t2.cos());
    let tip = (wrist.0 + LINKS[3] * t3.sin(), wrist.1 + LINKS[3] * t3.cos());
    let yaw = rad(j[0]);
    let lowest = elbow.1.min(wrist.1).min(tip.1);
    (
        [
            round(tip.0 * yaw.cos(), 4),
            round(tip.0 * yaw.sin(), 4),
            round(tip.1, 4),
        ],
        lowest,
    )
}

fn status(p: &Pose, motion_seconds: f64) -> Status {
    let now = now_ms();
    let mut p = p.clone();
    let moving = p.motion.as_ref().is_some_and(|m| !m.done(now));
    settle(&mut p, now, false);
    Status {
        base: p.joints[0],
        shoulder: p.joints[1],
        elbow: p.joints[2],
        wrist: p.joints[3],
        gripper: p.gripper,
        tool: tool_position(&p.joints).0,
        motion_seconds: round(motion_seconds, 3),
        stops: p.stops,
        moving,
        interrupted: p.interrupted,
    }
}

/// Milliseconds since the Unix epoch (the sandbox's wall clock).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Puts the recorded jog's joint where the clock says it is; with `end`, the jog is over (cut short
/// if its time is not up: counted as interrupted).
fn settle(p: &mut Pose, now: u64, end: bool) {
    let Some(m) = p.motion.clone() else { return };
    p.joints[m.joint] = round(m.at(now), 3);
    if end || m.done(now) {
        if !m.done(now) {
            p.interrupted += 1;
        }
        p.motion = None;
    }
}

fn load() -> Result<Pose, String> {
    match std::fs::read_to_string(STATE) {
        Ok(t) => serde_json::from_str(&t).map_err(|e| format!("the arm's state is damaged: {e}")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Pose::default()),
        Err(e) => Err(format!(
            "cannot read the arm's state: {e} (is /state granted?)"
        )),
    }
}

fn save(p: &Pose) -> Result<(), String> {
    let text = serde_json::to_string(p).map_err(|e| e.to_string())?;
    let tmp = format!("{STATE}.tmp");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, STATE))
        .map_err(|e| format!("cannot save the arm's state: {e} (is /state granted read-write?)"))
}

/// Applies a move to `from`: the new pose and the time it takes, or why it is refused.
pub fn plan(from: &Pose, m: &Move) -> Result<(Pose, f64), String> {
    let targets = [m.base, m.shoulder, m.elbow, m.wrist];
    let mut to = from.clone();
    for (i, (t, (name, lo, hi))) in targets.iter().zip(LIMITS).enumerate() {
        if let Some(t) = *t {
            if !t.is_finite() || t < lo || t > hi {
                return Err(format!(
                    "refused: {name} {t} degrees is outside its limits [{lo}, {hi}]"
                ));
            }
            to.joints[i] = t;
        }
    }
    if let Some(g) = m.gripper {
        if !(0.0..=100.0).contains(&g) {
            return Err(format!("refused: gripper {g}% is outside [0, 100]"));
        }
        to.gripper = g;
    }
    let (tip, lowest) = tool_position(&to.joints);
    if lowest < 0.0 {
        return Err(format!(
            "refused: that pose puts the arm {:.3} m below the table (tool tip at z = {} m)",
            -lowest, tip[2]
        ));
    }
    let speed = m.speed.unwrap_or(50.0);
    if !(1.0..=100.0).contains(&speed) {
        return Err(format!("refused: speed {speed}% is outside [1, 100]"));
    }
    let travel = from
        .joints
        .iter()
        .zip(to.joints)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    Ok((to, travel / (MAX_SPEED * speed / 100.0)))
}

/// Refuses while a jog moves the arm (it must be stopped, or run its time, first).
fn still(p: &mut Pose) -> Result<(), String> {
    let now = now_ms();
    if p.motion.as_ref().is_some_and(|m| !m.done(now)) {
        return Err("refused: the arm is moving (a jog); stop it first".into());
    }
    settle(p, now, true);
    Ok(())
}

/// Plans a jog from `from` at `now`: the motion, or why it is refused (a limit or the table on the way).
pub fn plan_jog(from: &Pose, j: &Jog, now: u64) -> Result<Motion, String> {
    let joint = j.joint as usize;
    let (name, lo, hi) = LIMITS[joint];
    if !j.velocity.is_finite() || j.velocity.abs() > MAX_SPEED {
        return Err(format!(
            "refused: {} degrees per second is outside [-{MAX_SPEED}, {MAX_SPEED}]",
            j.velocity
        ));
    }
    if j.duration_ms == 0 || j.duration_ms > MAX_JOG_MS {
        return Err(format!(
            "refused: a jog lasts 1 to {MAX_JOG_MS} ms, not {}",
            j.duration_ms
        ));
    }
    let m = Motion {
        joint,
        from: from.joints[joint],
        velocity: j.velocity,
        start_ms: now,
        duration_ms: j.duration_ms,
    };
    // The joint passes every angle between: check the way at small steps, not just the end.
    for k in 0..=20 {
        let a = m.at(now + j.duration_ms * k / 20);
        if a < lo || a > hi {
            return Err(format!(
                "refused: that jog takes {name} to {a:.1} degrees, outside its limits [{lo}, {hi}]"
            ));
        }
        let mut joints = from.joints;
        joints[joint] = a;
        if tool_position(&joints).1 < 0.0 {
            return Err("refused: that jog drives the arm into the table".into());
        }
    }
    Ok(m)
}

/// Jogs one joint: the call lasts as long as the motion (see the module docs).
pub fn jog(j: Jog) -> Result<Status, String> {
    let mut p = load()?;
    still(&mut p)?;
    let m = plan_jog(&p, &j, now_ms())?;
    p.motion = Some(m.clone());
    save(&p)?;
    std::thread::sleep(std::time::Duration::from_millis(m.duration_ms));
    // A stop from another call may have ended it meanwhile: report what the state says, and for how
    // long the joint moved.
    let mut p = load()?;
    if p.motion.as_ref() == Some(&m) {
        settle(&mut p, m.start_ms + m.duration_ms, true);
        save(&p)?;
    }
    let moved = (p.joints[m.joint] - m.from).abs() / m.velocity.abs().max(f64::MIN_POSITIVE);
    Ok(status(&p, moved.min(m.duration_ms as f64 / 1000.0)))
}

/// Moves the joints (absolute targets), if the move is safe.
pub fn move_joints(m: Move) -> Result<Status, String> {
    let mut from = load()?;
    still(&mut from)?;
    let (to, secs) = plan(&from, &m)?;
    save(&to)?;
    Ok(status(&to, secs))
}

/// Reports the pose without moving.
pub fn state(_: Nothing) -> Result<Status, String> {
    Ok(status(&load()?, 0.0))
}

/// Stops all motion where the arm is (the simulator records that the stop arrived).
pub fn stop(_: Nothing) -> Result<Status, String> {
    let mut p = load()?;
    settle(&mut p, now_ms(), true);
    p.stops += 1;
    save(&p)?;
    Ok(status(&p, 0.0))
}

/// Returns to the home pose.
pub fn home(_: Nothing) -> Result<Status, String> {
    let mut from = load()?;
    // Home stops a jog first (it is a stop: it must always work).
    settle(&mut from, now_ms(), true);
    let h = Pose {
        stops: from.stops,
        interrupted: from.interrupted,
        ..Pose::default()
    };
    let (to, secs) = plan(
        &from,
        &Move {
            base: Some(h.joints[0]),
            shoulder: Some(h.joints[1]),
            elbow: Some(h.joints[2]),
            wrist: Some(h.joints[3]),
            gripper: Some(h.gripper),
            speed: None,
        },
    )?;
    save(&to)?;
    Ok(status(&to, secs))
}

thorn_plugin_sdk::plugin!(
    Plugin::new(
        "robot_arm",
        "0.1.0",
        "A simulated 4-joint robot arm with a gripper. Joint limits: base -170..170, shoulder -90..90, elbow 0..150, wrist -120..120 degrees."
    )
    .wants_dir("/state", "read-write")
    .function(
        "move_joints",
        "Moves (rotates, turns, bends) the arm's joints to absolute angles in degrees and/or opens or closes the gripper; joints left out stay put. Refuses moves outside the joint limits or into the table.",
        move_joints
    )
    .example("Swing the base of the arm to -30 degrees.", json!({"base": -30}))
    .example(
        "Raise the shoulder to 15 degrees and bend the elbow to 60.",
        json!({"shoulder": 15, "elbow": 60})
    )
    .example("Set the gripper to 25 percent open.", json!({"gripper": 25}))
    .example("Tilt the wrist down to -45 degrees.", json!({"wrist": -45}))
    .answer("Moved in {{ result.motion_seconds | num }} s: base {{ result.base | num }}°, shoulder {{ result.shoulder | num }}°, elbow {{ result.elbow | num }}°, wrist {{ result.wrist | num }}°, gripper {{ result.gripper | num }}% open, tool tip at ({{ result.tool | map('num') | join(', ') }}) m.")
    .destructive(true)
    .function(
        "arm_state",
        "Reports the arm's current state: where it is, its joint angles, the gripper and the tool tip position.",
        state
    )
    .example("What pose is the arm in?", json!({}))
    .example("Read the arm's joint positions.", json!({}))
    .answer("The arm is at base {{ result.base | num }}°, shoulder {{ result.shoulder | num }}°, elbow {{ result.elbow | num }}°, wrist {{ result.wrist | num }}°, gripper {{ result.gripper | num }}% open, tool tip at ({{ result.tool | map('num') | join(', ') }}) m.")
    .read_only()
    .function(
        "arm_jog",
        "Jogs (turns, swings) one joint at a constant speed in degrees per second for a time in milliseconds; the call lasts as long as the motion.",
        jog
    )
    .example("Jog the base at 20 degrees per second for 2 seconds.", json!({"joint": "base", "velocity": 20, "duration_ms": 2000}))
    .example("Turn the wrist slowly the other way for half a second.", json!({"joint": "wrist", "velocity": -10, "duration_ms": 500}))
    .answer("Jogged for {{ result.motion_seconds | num }} s: base {{ result.base | num }}°, shoulder {{ result.shoulder | num }}°, elbow {{ result.elbow | num }}°, wrist {{ result.wrist | num }}°.")
    .destructive(false)
    .deadman(MAX_JOG_MS + 500, "arm_stop")
    .function("arm_home", "Moves (resets) the arm back to its home pose.", home)
    .example("Return the arm to its rest pose.", json!({}))
    .answer("Back home in {{ result.motion_seconds | num }} s: base {{ result.base | num }}°, shoulder {{ result.shoulder | num }}°, elbow {{ result.elbow | num }}°, wrist {{ result.wrist | num }}°, gripper {{ result.gripper | num }}% open, tool tip at ({{ result.tool | map('num') | join(', ') }}) m.")
    .destructive(true)
    .stop()
    .function("arm_stop", "Stops (halts, freezes) all of the arm's motion at once, where it is.", stop)
    .example("Stop the arm now!", json!({}))
    .answer("Stopped: base {{ result.base | num }}°, shoulder {{ result.shoulder | num }}°, elbow {{ result.elbow | num }}°, wrist {{ result.wrist | num }}°.")
    .destructive(true)
    .stop()
);

#[cfg(test)]
mod tests {
    use super::*;

    fn mv(shoulder: Option<f64>, elbow: Option<f64>) -> Move {
        Move {
            base: None,
            shoulder,
            elbow,
            wrist: None,
            gripper: None,
            speed: Some(100.0),
        }
    }

    #[test]
    fn kinematics_of_known_poses() {
        // Straight up: everything stacked on the z axis.
        let (tip, _) = tool_position(&[0.0, 0.0, 0.0, 0.0]);
        assert_eq!(tip, [0.0, 0.0, 0.63]);
        // Home: forearm horizontal forward.
        let (tip, low) = tool_position(&Pose::default().joints);
        assert_eq!(tip, [0.28, 0.0, 0.35]);
        assert!(low > 0.0);
        // Base turned 90 degrees moves the tip to +y.
        let (tip, _) = tool_position(&[90.0, 0.0, 90.0, 0.0]);
        assert_eq!(tip, [0.0, 0.28, 0.35]);
    }

    #[test]
    fn refuses_unsafe_moves() {
        let home = Pose::default();
        let e = plan(&home, &mv(Some(95.0), None)).unwrap_err();
        assert!(e.contains("shoulder 95 degrees is outside"), "{e}");
        let e = plan(&home, &mv(Some(90.0), Some(90.0))).unwrap_err();
        assert!(e.contains("below the table"), "{e}");
        let (to, secs) = plan(&home, &mv(Some(30.0), None)).unwrap();
        assert_eq!(to.joints, [0.0, 30.0, 90.0, 0.0]);
        assert!((secs - 30.0 / 90.0).abs() < 1e-9);
    }

    #[test]
    fn a_jog_moves_with_the_clock_and_is_refused_past_a_limit_or_into_the_table() {
        let home = Pose::default();
        let j = |joint, velocity, duration_ms| Jog {
            joint,
            velocity,
            duration_ms,
        };
        let m = plan_jog(&home, &j(Joint::Base, 20.0, 2000), 1_000).unwrap();
        assert_eq!(
            (m.at(1_000), m.at(2_000), m.at(3_000), m.at(9_000)),
            (0.0, 20.0, 40.0, 40.0)
        );
        assert!(!m.done(2_999) && m.done(3_000));
        let e = plan_jog(&home, &j(Joint::Base, 90.0, 2000), 0).unwrap_err();
        assert!(e.contains("outside its limits"), "{e}");
        let e = plan_jog(&home, &j(Joint::Shoulder, 90.0, 1000), 0).unwrap_err();
        assert!(e.contains("into the table"), "{e}");
        assert!(plan_jog(&home, &j(Joint::Base, 91.0, 10), 0).is_err());
        assert!(plan_jog(&home, &j(Joint::Base, 1.0, MAX_JOG_MS + 1), 0).is_err());
        // A stop mid-jog freezes the joint where the clock says, and counts it as cut short.
        let mut p = Pose {
            motion: Some(m.clone()),
            ..Pose::default()
        };
        settle(&mut p, 1_500, true);
        assert_eq!(
            (p.joints[0], p.motion.is_none(), p.interrupted),
            (10.0, true, 1)
        );
        // One that ran its time is simply over.
        let mut p = Pose {
            motion: Some(m),
            ..Pose::default()
        };
        settle(&mut p, 5_000, true);
        assert_eq!((p.joints[0], p.interrupted), (40.0, 0));
    }

    #[test]
    fn schema_carries_the_limits() {
        let s = thorn_plugin_sdk::schema_of::<Move>();
        assert_eq!(s["properties"]["elbow"]["maximum"], 150.0);
        assert_eq!(s["properties"]["shoulder"]["minimum"], -90.0);
    }
}
