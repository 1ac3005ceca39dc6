//! Rate limits and budgets from the operator's policy (a plugin entry's `rates`, per function or `"*"`
//! for all of its functions), enforced where a call is admitted, before anything runs:
//!
//! - `per_minute`: calls of the function in any 60 s, all callers together;
//! - `per_key_per_minute`: the same for each API key (calls without a key count as one caller);
//! - `per_key_per_day`: calls of the function per API key per UTC day;
//! - `per_request`: calls of the function in one request (one agent run, all its rounds);
//! - `max_step`: for named numeric arguments, how far one call may move the value from the last one a
//!   call succeeded with (a joint's angle step; the first call sets it).
//!
//! Over a limit the call is refused with a typed `rate_limited` tool error the model sees (and the call
//! metrics count), naming the limit. A refused call uses none of the budgets, and a function the manifest
//! marks `"stop": true` is never limited. Counts live in memory: a
//! restart (or a reload of the plugin) starts them afresh.

use serde_json::Value;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One function's limits (see the module docs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RateRules {
    /// Calls in any minute, all callers.
    pub per_minute: Option<u32>,
    /// Calls in any minute, per API key.
    pub per_key_per_minute: Option<u32>,
    /// Calls per API key per UTC day.
    pub per_key_per_day: Option<u32>,
    /// Calls in one request.
    pub per_request: Option<u32>,
    /// Argument name -> the most it may move in one call.
    pub max_step: BTreeMap<String, f64>,
}

impl RateRules {
    /// Reads a policy's `rates` entry (already checked against the policy schema).
    pub fn from_policy(v: &Value) -> Self {
        let n = |k: &str| v[k].as_u64().map(|x| x.min(u64::from(u32::MAX)) as u32);
        RateRules {
            per_minute: n("per_minute"),
            per_key_per_minute: n("per_key_per_minute"),
            per_key_per_day: n("per_key_per_day"),
            per_request: n("per_request"),
            max_step: v["max_step"]
                .as_object()
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, x)| x.as_f64().map(|x| (k.clone(), x)))
                        .collect()
                })
                .unwrap_or_default(),
        }
    }
}

const MINUTE: Duration = Duration::from_secs(60);

/// A plugin's counts: its calls in the last minute (per function, and per function and key), per key
/// per day, and the last values of stepped arguments.
#[derive(Debug, Default)]
pub struct RateState {
    inner: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    /// (function, key or None for all callers) -> admission times within the last minute.
    minute: HashMap<(String, Option<String>), VecDeque<Instant>>,
    /// (function, key, day) -> calls.
    day: HashMap<(String, String, u64), u32>,
    /// (function, argument) -> the last value a call succeeded with.
    last: HashMap<(String, String), f64>,
    /// (function, request) -> calls, and when the request's first call came (old ones are dropped).
    request: HashMap<(String, String), (u32, Instant)>,
}

/// How long a request's count is kept after its first call (longer than any request runs).
const REQUEST_KEPT: Duration = Duration::from_secs(3600);

impl RateState {
    /// Admits a call of `function` by `key` with `args` under `rules` at `now` (on UTC day `day`), and
    /// counts it; or says which limit refuses it (and counts nothing).
    #[expect(clippy::too_many_arguments, reason = "one call's facts, spelled out")]
    pub fn admit(
        &self,
        rules: &RateRules,
        function: &str,
        key: Option<&str>,
        request: Option<&str>,
        args: &Value,
        now: Instant,
        day: u64,
    ) -> Result<(), String> {
        let mut c = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let who = key.unwrap_or("");
        for (arg, step) in &rules.max_step {
            let (Some(new), Some(&old)) = (
                args[arg.as_str()].as_f64(),
                c.last.get(&(function.to_owned(), arg.clone())),
            ) else {
                continue;
            };
            if (new - old).abs() > *step {
                return Err(format!(
                    "{function}: {arg} may move at most {step} in one call (from {old} to {new} is {})",
                    (new - old).abs()
                ));
            }
        }
        let windows = [
            (None, rules.per_minute, "calls per minute"),
            (
                Some(who),
                rules.per_key_per_minute,
                "calls per minute for this key",
            ),
        ];
        for (k, limit, what) in windows {
            let Some(limit) = limit else { continue };
            let q = c
                .minute
                .entry((function.to_owned(), k.map(str::to_owned)))
                .or_default();
            while q.front().is_some_and(|&t| now.duration_since(t) >= MINUTE) {
                q.pop_front();
            }
            if q.len() >= limit as usize {
                let wait = q
                    .front()
                    .map_or(MINUTE, |&t| MINUTE.saturating_sub(now.duration_since(t)));
                return Err(format!(
                    "{function}: at most {limit} {what}; try again in {} s",
                    wait.as_secs().max(1)
                ));
            }
        }
        if let Some(limit) = rules.per_key_per_day {
            let used = c
                .day
                .get(&(function.to_owned(), who.to_owned(), day))
                .copied()
                .unwrap_or(0);
            if used >= limit {
                return Err(format!(
                    "{function}: this key's budget of {limit} calls for the day is spent"
                ));
            }
        }
        if let (Some(limit), Some(req)) = (rules.per_request, request) {
            let used = c
                .request
                .get(&(function.to_owned(), req.to_owned()))
                .map_or(0, |e| e.0);
            if used >= limit {
                return Err(format!("{function}: at most {limit} calls in one request"));
            }
        }
        // Admitted: count it.
        for (k, limit) in [
            (None, rules.per_minute),
            (Some(who), rules.per_key_per_minute),
        ] {
            if limit.is_some() {
                c.minute
                    .entry((function.to_owned(), k.map(str::to_owned)))
                    .or_default()
                    .push_back(now);
            }
        }
        if let (Some(_), Some(req)) = (rules.per_request, request) {
            if c.request.len() > 4096 {
                c.request
                    .retain(|_, (_, t)| now.duration_since(*t) < REQUEST_KEPT);
            }
            c.request
                .entry((function.to_owned(), req.to_owned()))
                .or_insert((0, now))
                .0 += 1;
        }
        if rules.per_key_per_day.is_some() {
            c.day.retain(|(_, _, d), _| *d == day);
            *c.day
                .entry((function.to_owned(), who.to_owned(), day))
                .or_default() += 1;
        }
        Ok(())
    }

    /// Notes the stepped arguments of a call of `function` that succeeded.
    pub fn succeeded(&self, rules: &RateRules, function: &str, args: &Value) {
        if rules.max_step.is_empty() {
            return;
        }
        let mut c = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        for arg in rules.max_step.keys() {
            if let Some(v) = args[arg.as_str()].as_f64() {
                c.last.insert((function.to_owned(), arg.clone()), v);
            }
        }
    }
}

/// Today's UTC day number.
pub fn today() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rules(v: Value) -> RateRules {
        RateRules::from_policy(&v)
    }

    #[test]
    fn minute_windows_refuse_past_the_limit_and_free_up_as_time_passes() {
        let s = RateState::default();
        let r = rules(json!({"per_minute": 3, "per_key_per_minute": 2}));
        let t0 = Instant::now();
        let a = |key, dt: u64| {
            s.admit(
                &r,
                "move",
                key,
                None,
                &json!({}),
                t0 + Duration::from_secs(dt),
                1,
            )
        };
        assert!(a(Some("k1"), 0).is_ok() && a(Some("k1"), 1).is_ok());
        let e = a(Some("k1"), 2).unwrap_err();
        assert!(e.contains("at most 2 calls per minute for this key"), "{e}");
        assert!(a(Some("k2"), 3).is_ok(), "another key has its own window");
        let e = a(Some("k3"), 4).unwrap_err();
        assert!(e.contains("at most 3 calls per minute;"), "{e}");
        // A minute after the first call, its slot is free again.
        assert!(a(Some("k1"), 60).is_ok());
    }

    #[test]
    fn day_budgets_count_per_key_and_refusals_use_none_of_them() {
        let s = RateState::default();
        let r = rules(json!({"per_key_per_day": 2, "per_minute": 100}));
        let t = Instant::now();
        assert!(s.admit(&r, "f", None, None, &json!({}), t, 7).is_ok());
        assert!(s.admit(&r, "f", None, None, &json!({}), t, 7).is_ok());
        let e = s.admit(&r, "f", None, None, &json!({}), t, 7).unwrap_err();
        assert!(e.contains("budget of 2 calls for the day"), "{e}");
        assert!(
            s.admit(&r, "f", None, None, &json!({}), t, 8).is_ok(),
            "a new day"
        );
        assert!(
            s.admit(&r, "f", Some("other"), None, &json!({}), t, 8)
                .is_ok()
        );
    }

    #[test]
    fn a_stepped_argument_moves_at_most_its_step_from_the_last_success() {
        let s = RateState::default();
        let r = rules(json!({"max_step": {"base": 15}}));
        let t = Instant::now();
        let call = |v: f64| s.admit(&r, "move", None, None, &json!({"base": v}), t, 1);
        assert!(call(40.0).is_ok(), "the first call sets it");
        s.succeeded(&r, "move", &json!({"base": 40.0}));
        let e = call(0.0).unwrap_err();
        assert!(
            e.contains("base may move at most 15 in one call (from 40 to 0 is 40)"),
            "{e}"
        );
        assert!(call(30.0).is_ok());
        // Not succeeded (the plugin refused it): the last value stays 40.
        assert!(call(55.0).is_ok());
        s.succeeded(&r, "move", &json!({"base": 55.0}));
        assert!(call(70.0).is_ok());
        assert!(call(30.0).is_err());
        // A call without the argument is not stepped.
        assert!(
            s.admit(&r, "move", None, None, &json!({"shoulder": 80}), t, 1)
                .is_ok()
        );
    }

    #[test]
    fn a_request_budget_counts_each_request_alone() {
        let s = RateState::default();
        let r = rules(json!({"per_request": 2}));
        let t = Instant::now();
        let call = |req| s.admit(&r, "move", None, Some(req), &json!({}), t, 1);
        assert!(call("r1").is_ok() && call("r1").is_ok());
        let e = call("r1").unwrap_err();
        assert!(e.contains("at most 2 calls in one request"), "{e}");
        assert!(call("r2").is_ok(), "a new request has its own budget");
    }
}
