//! The calculator tool: evaluates an arithmetic expression with a small recursive-descent parser (numbers,
//! `+ - * / % ^`, parentheses, `pi`, `e`, and `sqrt abs ln log10 exp sin cos tan floor ceil round`). Nothing
//! is executed; the input is bounded in length and nesting.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use thorn_plugin_sdk::{Plugin, json};

/// Arguments of `evaluate`.
#[derive(Deserialize, JsonSchema)]
pub struct Expr {
    /// The expression, e.g. `2 * (3 + 4) ^ 2 / sqrt(16)`.
    // Only characters the parser knows: a constrained model cannot wander off into prose or markup
    // inside the string (and a quote, which ends it, is always an option).
    #[schemars(length(min = 1, max = 1000), pattern(r"^[0-9A-Za-z_.+*/%^() -]+$"))]
    pub expression: String,
}

/// The value of an expression.
#[derive(Serialize, JsonSchema)]
pub struct Answer {
    /// The result.
    pub value: f64,
}

const MAX_DEPTH: usize = 64;

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    depth: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.s.get(self.i).is_some_and(u8::is_ascii_whitespace) {
            self.i += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.s.get(self.i).copied()
    }

    fn err<T>(&self, msg: &str) -> Result<T, String> {
        Err(format!("{msg} at character {}", self.i + 1))
    }

    fn expr(&mut self) -> Result<f64, String> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return self.err("expression nested too deeply");
        }
        let mut v = self.term()?;
        while let Some(op @ (b'+' | b'-')) = self.peek() {
            self.i += 1;
            let r = self.term()?;
            v = if op == b'+' { v + r } else { v - r };
        }
        self.depth -= 1;
        Ok(v)
    }

    fn term(&mut self) -> Result<f64, String> {
        let mut v = self.unary()?;
        while let Some(op @ (b'*' | b'/' | b'%')) = self.peek() {
            self.i += 1;
            let r = self.unary()?;
            v = match op {
                b'*' => v * r,
                b'/' if r == 0.0 => return self.err("division by zero"),
                b'/' => v / r,
                _ if r == 0.0 => return self.err("modulo by zero"),
                _ => v % r,
            };
        }
        Ok(v)
    }

    /// `atom ('^' unary)?`: right-associative, and binds tighter than a leading minus (`-2^2 = -4`).
    fn power(&mut self) -> Result<f64, String> {
        let base = self.atom()?;
        if self.peek() == Some(b'^') {
            self.i += 1;
            let exp = self.unary()?;
            return Ok(base.powf(exp));
        }
        Ok(base)
    }

    fn unary(&mut self) -> Result<f64, String> {
        if self.depth > MAX_DEPTH {
            return self.err("expression nested too deeply");
        }
        match self.peek() {
            Some(b'-') => {
                self.i += 1;
                self.depth += 1;
                let v = -self.unary()?;
                self.depth -= 1;
                Ok(v)
            }
            Some(b'+') => {
                self.i += 1;
                self.unary()
            }
            _ => self.power(),
        }
    }

    fn atom(&mut self) -> Result<f64, String> {
        match self.peek() {
            Some(b'(') => {
                self.i += 1;
                let v = self.expr()?;
                if self.peek() != Some(b')') {
                    return self.err("expected ')'");
                }
                self.i += 1;
                Ok(v)
            }
            Some(c) if c.is_ascii_digit() || c == b'.' => {
                let start = self.i;
                while self
                    .s
                    .get(self.i)
                    .is_some_and(|c| c.is_ascii_digit() || *c == b'.')
                {
                    self.i += 1;
                }
                if matches!(self.s.get(self.i), Some(b'e' | b'E'))
                    && self
                        .s
                        .get(self.i + 1)
                        .is_some_and(|c| c.is_ascii_digit() || *c == b'-' || *c == b'+')
                {
                    self.i += 2;
                    while self.s.get(self.i).is_some_and(u8::is_ascii_digit) {
                        self.i += 1;
                    }
                }
                let text = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("");
                text.parse::<f64>()
                    .map_err(|_| format!("bad number {text:?} at character {}", start + 1))
            }
            Some(c) if c.is_ascii_alphabetic() => {
                let start = self.i;
                while self
                    .s
                    .get(self.i)
                    .is_some_and(|c| c.is_ascii_alphanumeric())
                {
                    self.i += 1;
                }
                let name = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("");
                match name {
                    "pi" => return Ok(std::f64::consts::PI),
                    "e" => return Ok(std::f64::consts::E),
                    _ => {}
                }
                let f: fn(f64) -> f64 = match name {
                    "sqrt" => f64::sqrt,
                    "abs" => f64::abs,
                    "ln" => f64::ln,
                    "log10" => f64::log10,
                    "exp" => f64::exp,
                    "sin" => f64::sin,
                    "cos" => f64::cos,
                    "tan" => f64::tan,
                    "floor" => f64::floor,
                    "ceil" => f64::ceil,
                    "round" => f64::round,
                    _ => return Err(format!("unknown name {name:?} at character {}", start + 1)),
                };
                if self.peek() != Some(b'(') {
                    return self.err("expected '(' after a function name");
                }
                self.i += 1;
                let v = self.expr()?;
                if self.peek() != Some(b')') {
                    return self.err("expected ')'");
                }
                self.i += 1;
                Ok(f(v))
            }
            Some(_) => self.err("unexpected character"),
            None => self.err("unexpected end of expression"),
        }
    }
}

/// Evaluates `text`.
pub fn evaluate(text: &str) -> Result<f64, String> {
    if text.len() > 1000 {
        return Err("expression longer than 1000 characters".into());
    }
    let mut p = Parser {
        s: text.as_bytes(),
        i: 0,
        depth: 0,
    };
    let v = p.expr()?;
    if p.peek().is_some() {
        return p.err("unexpected trailing input");
    }
    if !v.is_finite() {
        return Err(format!("the result is not a finite number ({v})"));
    }
    Ok(v)
}

thorn_plugin_sdk::plugin!(
    Plugin::new(
        "calculator",
        "0.1.0",
        "A calculator: computes arithmetic exactly, so an answer never rests on mental math."
    )
    .function(
        "evaluate",
        "Calculates the value of an arithmetic expression: add or plus (+), subtract or minus (-), multiply or \
         times (*), divide (/), remainder or modulo (%), power (^), parentheses, percent (as division by \
         100), pi, e, and the functions sqrt abs ln log10 exp sin cos tan floor ceil round.",
        |x: Expr| evaluate(&x.expression).map(|value| Answer { value }),
    )
    .read_only()
    .example("What is 12 times 9?", json!({"expression": "12 * 9"}))
    .example("Add 4.5 and 3.25.", json!({"expression": "4.5 + 3.25"}))
    .example("What is 3 to the power of 4?", json!({"expression": "3 ^ 4"}))
    .example("What is 20 percent of 80?", json!({"expression": "20 / 100 * 80"}))
    .example("Find the square root of 81.", json!({"expression": "sqrt(81)"}))
    .example("Take 50 minus 8 and divide it by 6.", json!({"expression": "(50 - 8) / 6"}))
    .answer("{{ arguments.expression }} = {{ result.value | num }}")
);

#[cfg(test)]
mod tests {
    use super::evaluate;

    #[test]
    fn evaluates_and_rejects() {
        assert_eq!(evaluate("2 * (3 + 4) ^ 2 / sqrt(16)"), Ok(24.5));
        assert_eq!(evaluate("-2^2"), Ok(-4.0));
        assert_eq!(evaluate("2^3^2"), Ok(512.0));
        assert_eq!(evaluate("2^-1"), Ok(0.5));
        assert_eq!(evaluate("1.5e3 + 10 % 4"), Ok(1502.0));
        assert!(evaluate("1/0").unwrap_err().contains("division by zero"));
        assert!(evaluate("2 +").is_err());
        assert!(evaluate("system(1)").unwrap_err().contains("unknown name"));
        assert!(evaluate(&"(".repeat(500)).unwrap_err().contains("nested"));
        assert!(evaluate(&"-".repeat(500)).unwrap_err().contains("nested"));
    }
}
