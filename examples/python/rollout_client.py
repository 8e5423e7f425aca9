#!/usr/bin/env python3
"""An example client of a tandem rollout worker (`tandem serve`): generate over Thrift.

    python3 examples/python/rollout_client.py --address 127.0.0.1:9100 \\
        --messages '[{"role": "user", "content": "What is 2 + 3?"}]' --n 4 --max-tokens 32

It calls the RolloutService of rollout/service/rollout.thrift (framed transport, binary
protocol): info() first (the worker's model and limits, on stderr), then one generate() per
prompt given, and prints each answer as one JSON line on stdout: the request id, the prompt's
token ids, and per sample its token ids, text, logprobs, finish reason and weight version.
The prompt is one of --tokens (ids, comma-separated), --text (tokenized as it is) or --messages
(a JSON list of {"role", "content"}, rendered with the worker's chat template); --requests FILE
reads one JSON request per line instead ({"id", "tokens" | "text" | "messages", "n",
"max_tokens", "temperature", "seed", ...}).

The worker's typed errors are told apart: Overloaded is retried after a pause (--retries),
StaleWeights, InvalidRequest and Unauthorized end the client with a message and exit status 2.
The token is --token, or the environment variable TANDEM_ROLLOUT_TOKEN.

The Python code of the contract is generated at start by the `thrift` compiler (Debian:
thrift-compiler) into a temporary directory removed at exit, so the .thrift file stays the one
source of the contract. The runtime library is the `thrift` package (Debian: python3-thrift, for
/usr/bin/python3; or `pip install thrift==0.17.0`).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

try:
    from thrift.protocol import TBinaryProtocol
    from thrift.transport import TSocket, TTransport
except ImportError:
    sys.exit(
        "rollout_client.py: the Python package 'thrift' is missing for %s: install python3-thrift "
        "(Debian, for /usr/bin/python3) or `pip install thrift==0.17.0`" % sys.executable
    )

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_IDL = os.path.join(HERE, "..", "..", "rollout", "service", "rollout.thrift")


def generate_bindings(thrift_compiler, idl, out_dir):
    """Compiles the contract into Python modules under out_dir and makes them importable."""
    if shutil.which(thrift_compiler) is None:
        sys.exit(
            "rollout_client.py: the thrift compiler '%s' was not found: install thrift-compiler "
            "(or pass --thrift PATH)" % thrift_compiler
        )
    subprocess.run([thrift_compiler, "--gen", "py", "-out", out_dir, idl], check=True)
    sys.path.insert(0, out_dir)


def connect(address, timeout_s, RolloutService):
    host, _, port = address.rpartition(":")
    socket = TSocket.TSocket(host.strip("[]"), int(port))
    socket.setTimeout(timeout_s * 1000.0)
    transport = TTransport.TFramedTransport(socket)
    client = RolloutService.Client(TBinaryProtocol.TBinaryProtocol(transport))
    transport.open()
    return client, transport


def request_of(spec, default_id, ttypes):
    """A GenerateRequest from a dict of the --requests form."""
    params = ttypes.SamplingParams(
        n=spec.get("n", 1),
        temperature=spec.get("temperature", 1.0),
        top_p=spec.get("top_p", 1.0),
        top_k=spec.get("top_k", 0),
        max_tokens=spec.get("max_tokens", 32),
        seed=spec.get("seed", 0),
        stop=spec.get("stop", []),
        stop_token_ids=spec.get("stop_token_ids", []),
        logprobs=True,
    )
    r = ttypes.GenerateRequest(
        request_id=str(spec.get("id", default_id)),
        params=params,
        min_weight_version=spec.get("min_weight_version", 0),
        prompt_tokens=[],
        messages=[],
    )
    if "tokens" in spec:
        r.prompt_tokens = [int(t) for t in spec["tokens"]]
    elif "messages" in spec:
        r.messages = [ttypes.Message(role=m["role"], content=m["content"]) for m in spec["messages"]]
    else:
        r.prompt_text = spec.get("text", "")
    return r


def as_json(response, ttypes):
    return {
        "request_id": response.request_id,
        "prompt_tokens": list(response.prompt_tokens),
        "aborted": response.aborted,
        "samples": [
            {
                "tokens": list(s.tokens),
                "text": s.text,
                "logprobs": list(s.logprobs),
                "finish_reason": ttypes.FinishReason._VALUES_TO_NAMES[s.finish_reason].lower(),
                "weight_version": s.weight_version,
            }
            for s in response.samples
        ],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", default="127.0.0.1:9100", help="host:port of the worker")
    parser.add_argument("--token", default=os.environ.get("TANDEM_ROLLOUT_TOKEN", ""))
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", help="prompt token ids, comma-separated")
    prompt.add_argument("--text", help="prompt text, tokenized as it is")
    prompt.add_argument("--messages", help="a JSON list of chat messages")
    prompt.add_argument("--requests", help="a file of JSON requests, one per line")
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--retries", type=int, default=3, help="retries after Overloaded")
    parser.add_argument("--idl", default=DEFAULT_IDL, help="rollout/service/rollout.thrift")
    parser.add_argument("--thrift", default="thrift", help="the thrift compiler")
    args = parser.parse_args()

    gen_dir = tempfile.mkdtemp(prefix="tandem-rollout-py-")
    try:
        generate_bindings(args.thrift, args.idl, gen_dir)
        from tandem_rollout import RolloutService, constants, ttypes  # noqa: E402 (generated)

        if args.requests:
            with open(args.requests) as f:
                specs = [json.loads(line) for line in f if line.strip()]
        else:
            spec = {"n": args.n, "max_tokens": args.max_tokens,
                    "temperature": args.temperature, "seed": args.seed}
            if args.tokens:
                spec["tokens"] = [int(t) for t in args.tokens.split(",")]
            elif args.messages:
                spec["messages"] = json.loads(args.messages)
            else:
                spec["text"] = args.text
            specs = [spec]

        client, transport = connect(args.address, args.timeout_s, RolloutService)
        try:
            info = client.info(args.token)
            if info.protocol_version != constants.PROTOCOL_VERSION:
                sys.exit("rollout_client.py: the worker speaks protocol %d, this client %d" %
                         (info.protocol_version, constants.PROTOCOL_VERSION))
            print("worker '%s' (tandem %s): %s, at most %d samples and %d new tokens per request"
                  % (info.name, info.version, info.model, info.max_n, info.max_new_tokens),
                  file=sys.stderr)
            for i, spec in enumerate(specs):
                request = request_of(spec, "py-%d" % i, ttypes)
                request.token = args.token
                for attempt in range(args.retries + 1):
                    try:
                        response = client.generate(request)
                        break
                    except ttypes.Overloaded as e:
                        if attempt == args.retries:
                            raise
                        print("overloaded (%s); retrying" % e.message, file=sys.stderr)
                        time.sleep(0.1 * 2 ** attempt)
                print(json.dumps(as_json(response, ttypes)), flush=True)
        except (ttypes.InvalidRequest, ttypes.Unauthorized, ttypes.StaleWeights,
                ttypes.Overloaded, ttypes.Internal) as e:
            print("rollout_client.py: the worker refused: %s: %s" % (type(e).__name__, e.message),
                  file=sys.stderr)
            return 2
        finally:
            transport.close()
    finally:
        shutil.rmtree(gen_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
