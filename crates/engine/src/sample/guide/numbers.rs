//! A guard that keeps JSON number literals within what a 64-bit float can hold.
//!
//! JSON (and llguidance's `%json` number lexeme) allows any number of digits and any exponent, but the
//! parser on the other side (serde_json, like most) reads numbers as `f64` and rejects `9.9E+10137456807`
//! as "number out of range". Measured on BFCL at temperature 1.0, about 1 call in 2,000 ran into it. The
//! grammar cannot bound the exponent (llguidance drops exponent notation entirely once a numeric range is
//! set), so this guard does it beside the grammar: an integer part of at most [`MAX_INT_DIGITS`] digits and
//! an exponent of at most [`MAX_EXP_DIGITS`], which keeps every literal below about 1e300.

/// Most digits before the decimal point.
pub const MAX_INT_DIGITS: u16 = 200;
/// Most exponent digits.
pub const MAX_EXP_DIGITS: u16 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum State {
    #[default]
    Out,
    Str,
    StrEscape,
    Int,
    Frac,
    ExpSign,
    Exp,
}

/// Where the JSON text is, as far as numbers are concerned.
#[derive(Debug, Clone, Copy, Default)]
pub struct NumberGuard {
    state: State,
    int_digits: u16,
    exp_digits: u16,
}

impl NumberGuard {
    /// Whether the text is inside a number literal.
    pub fn in_number(&self) -> bool {
        matches!(
            self.state,
            State::Int | State::Frac | State::ExpSign | State::Exp
        )
    }

    /// Advances over `bytes`; returns `false` if a number went past the limits on the way.
    pub fn advance(&mut self, bytes: &[u8]) -> bool {
        let mut ok = true;
        for &b in bytes {
            self.step(b);
            ok &= self.int_digits <= MAX_INT_DIGITS && self.exp_digits <= MAX_EXP_DIGITS;
        }
        ok
    }

    /// Whether appending `bytes` keeps every number within the limits (nothing is changed).
    pub fn accepts(&self, bytes: &[u8]) -> bool {
        let mut g = *self;
        g.advance(bytes)
    }

    fn step(&mut self, b: u8) {
        match self.state {
            State::Str => match b {
                b'\\' => self.state = State::StrEscape,
                b'"' => self.state = State::Out,
                _ => {}
            },
            State::StrEscape => self.state = State::Str,
            State::Int => match b {
                b'0'..=b'9' => self.int_digits += 1,
                b'.' => self.state = State::Frac,
                b'e' | b'E' => self.state = State::ExpSign,
                _ => self.leave(b),
            },
            State::Frac => match b {
                b'0'..=b'9' => {}
                b'e' | b'E' => self.state = State::ExpSign,
                _ => self.leave(b),
            },
            State::ExpSign => match b {
                b'+' | b'-' => self.state = State::Exp,
                b'0'..=b'9' => {
                    self.state = State::Exp;
                    self.exp_digits = 1;
                }
                _ => self.leave(b),
            },
            State::Exp => match b {
                b'0'..=b'9' => self.exp_digits += 1,
                _ => self.leave(b),
            },
            State::Out => self.enter(b),
        }
    }

    fn leave(&mut self, b: u8) {
        *self = NumberGuard::default();
        self.enter(b);
    }

    fn enter(&mut self, b: u8) {
        match b {
            b'"' => self.state = State::Str,
            b'-' => self.state = State::Int,
            b'0'..=b'9' => {
                self.state = State::Int;
                self.int_digits = 1;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_exponents_and_integer_digits_outside_strings() {
        let mut g = NumberGuard::default();
        assert!(g.advance(br#"{"a":1.5e10,"b":"9e99999 in a string \" still","c":-12"#));
        assert!(g.in_number());
        assert!(g.accepts(b"34}"));
        assert!(g.accepts(b"e-99,"));
        assert!(!g.accepts(b"e123"), "three exponent digits");
        assert!(g.advance(b"e+9"));
        assert!(!g.accepts(b"99"));
        assert!(g.accepts(b"9]"));
        let mut g = NumberGuard::default();
        assert!(g.advance(&[b'1'; 200]));
        assert!(!g.accepts(b"1"));
        assert!(g.accepts(b".123456789e5"));
        assert!(g.advance(b","));
        assert!(!g.in_number());
    }
}
