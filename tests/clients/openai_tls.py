"""The openai SDK against thorn over HTTPS, trusting a CA the test made.

Usage: python openai_tls.py BASE_URL CA_FILE
Prints one JSON object: a plain and a streamed answer through a client that trusts CA_FILE, and what a
client trusting only the system's roots got (an error: the certificate is not theirs).
"""

import json
import ssl
import sys

import httpx
from openai import APIConnectionError, OpenAI

base, ca = sys.argv[1], sys.argv[2]
trusted = OpenAI(api_key="unused", base_url=base + "/v1", max_retries=0, timeout=300,
                 http_client=httpx.Client(verify=ssl.create_default_context(cafile=ca)))
model = trusted.models.list().data[0].id
messages = [{"role": "user", "content": "Say hello."}]
plain = trusted.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
streamed = "".join(
    c.choices[0].delta.content or ""
    for c in trusted.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                             stream=True)
    if c.choices
)
untrusted = OpenAI(api_key="unused", base_url=base + "/v1", max_retries=0, timeout=30)
try:
    untrusted.models.list()
    refused = None
except APIConnectionError as e:
    refused = repr(e.__cause__ or e)
print(json.dumps({"model": model, "plain": plain.choices[0].message.content, "streamed": streamed,
                  "untrusted_error": refused}))
