#!/usr/bin/env python3
"""An example remote reward server for tandem: math answers scored over Thrift.

    python3 examples/python/reward_server.py --port 9090 [--token SECRET]

It serves the RewardService of rewards/reward.thrift (framed transport, binary protocol) on
127.0.0.1 and prints "listening on PORT" once it accepts connections (--port 0 picks a free port).
A sample scores 1.0 when the number after the last "####" of the completion (else its last
number) equals the reference answer's, else 0.0; a sample without a reference answer is one the
server cannot judge (ok = false). SIGTERM or Ctrl-C stops it.

The Python code of the contract is generated when the server starts, by the `thrift` compiler
(Debian: thrift-compiler) into a temporary directory that is removed at exit, so the .thrift file
stays the one source of the contract. The runtime library is the `thrift` package (Debian:
python3-thrift, for /usr/bin/python3; or `pip install thrift==0.17.0`).

Replace `score_sample` with your own judgement; keep the bounds and typed errors.
"""

import argparse
import hmac
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types

try:
    from thrift.protocol import TBinaryProtocol
    from thrift.transport import TSocket, TTransport
except ImportError:
    sys.exit(
        "reward_server.py: the Python package 'thrift' is missing for %s: install python3-thrift "
        "(Debian, for /usr/bin/python3) or `pip install thrift==0.17.0`" % sys.executable
    )

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_IDL = os.path.join(HERE, "..", "..", "rewards", "reward.thrift")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def generate_bindings(thrift_compiler, idl, out_dir):
    """Compiles the contract into Python modules under out_dir and makes them importable."""
    if shutil.which(thrift_compiler) is None:
        sys.exit(
            "reward_server.py: the thrift compiler '%s' was not found: install thrift-compiler "
            "(or pass --thrift PATH)" % thrift_compiler
        )
    subprocess.run([thrift_compiler, "--gen", "py", "-out", out_dir, idl], check=True)
    sys.path.insert(0, out_dir)


def as_number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def final_answer(text, last_number_fallback):
    """The text after the last '####' (its first line), else the last number, else None."""
    if "####" in text:
        lines = text.rsplit("####", 1)[1].strip().splitlines()
        return lines[0].strip() if lines else ""
    if last_number_fallback:
        numbers = NUMBER.findall(text)
        return numbers[-1] if numbers else None
    return text.strip()


def score_sample(sample):
    """(value, ok, error) of one sample: 1.0 when the completion's answer equals the reference."""
    reference = final_answer(sample.answer, last_number_fallback=False)
    if not reference:
        return 0.0, False, "the sample has no reference answer"
    predicted = final_answer(sample.completion, last_number_fallback=True)
    if predicted is None:
        return 0.0, True, ""
    ref_num, pred_num = as_number(reference), as_number(predicted.rstrip("."))
    if ref_num is not None and pred_num is not None:
        same = abs(ref_num - pred_num) <= 1e-9 * max(1.0, abs(ref_num))
    else:
        same = predicted.strip().lower() == reference.strip().lower()
    return (1.0 if same else 0.0), True, ""


class Handler:
    """The RewardService methods; the generated processor turns what they raise into replies."""

    def __init__(self, rpc, args):
        self.rpc = rpc
        self.args = args
        # Requests scored at once; one more is answered with Overloaded, which clients retry.
        self.in_flight = threading.BoundedSemaphore(args.max_in_flight)

    def score(self, request):
        t = self.rpc.ttypes
        if self.args.token and not hmac.compare_digest(
            request.token.encode("utf-8"), self.args.token.encode("utf-8")
        ):
            raise t.Unauthorized("wrong token" if request.token else "this server requires a token")
        if len(request.samples) > self.args.max_batch_size:
            raise t.InvalidRequest(
                "%d samples in one request, at most %d"
                % (len(request.samples), self.args.max_batch_size)
            )
        for i, s in enumerate(request.samples):
            try:
                extra = json.loads(s.extra_json or "{}")
            except ValueError as e:
                raise t.InvalidRequest("samples[%d].extra_json is not JSON: %s" % (i, e))
            if not isinstance(extra, dict):
                raise t.InvalidRequest("samples[%d].extra_json is not a JSON object" % i)
        if not self.in_flight.acquire(blocking=False):
            raise t.Overloaded("%d requests are being scored" % self.args.max_in_flight)
        try:
            scores = []
            for s in request.samples:
                value, ok, error = score_sample(s)
                scores.append(t.Score(value=value, ok=ok, error=error))
        finally:
            self.in_flight.release()
        return t.ScoreResponse(scores=scores, request_id=request.request_id)

    def health(self):
        return True

    def info(self):
        return self.rpc.ttypes.ServerInfo(
            name="python-math",
            version="0.1",
            protocol_version=self.rpc.constants.PROTOCOL_VERSION,
            max_batch_size=self.args.max_batch_size,
        )


class BoundedReads(TTransport.TTransportBase):
    """A socket transport that refuses a read (a frame) larger than max_bytes before reading it."""

    def __init__(self, inner, max_bytes):
        self.inner = inner
        self.max_bytes = max_bytes

    def isOpen(self):
        return self.inner.isOpen()

    def open(self):
        self.inner.open()

    def close(self):
        self.inner.close()

    def read(self, sz):
        return self.inner.read(sz)

    def readAll(self, sz):
        if sz < 0 or sz > self.max_bytes:
            raise TTransport.TTransportException(
                TTransport.TTransportException.SIZE_LIMIT,
                "a frame of %d bytes, at most %d" % (sz, self.max_bytes),
            )
        return self.inner.readAll(sz)

    def write(self, buf):
        self.inner.write(buf)

    def flush(self):
        self.inner.flush()


def serve_connection(processor, client, args):
    transport = TTransport.TFramedTransport(BoundedReads(client, args.max_message_bytes))
    protocol = TBinaryProtocol.TBinaryProtocol(
        transport,
        string_length_limit=args.max_message_bytes,
        container_length_limit=args.max_batch_size,
    )
    try:
        while True:
            processor.process(protocol, protocol)
    except TTransport.TTransportException:
        pass  # the client went away, timed out, or sent an oversized frame
    except Exception as e:  # a malformed request: drop this connection, keep serving
        print("reward_server.py: closing a connection: %r" % e, file=sys.stderr)
    finally:
        transport.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=9090, help="0: a free port (default: %(default)s)")
    parser.add_argument("--token", default=os.environ.get("TANDEM_REWARD_TOKEN", ""),
                        help="require this shared token (default: $TANDEM_REWARD_TOKEN, else none)")
    parser.add_argument("--max-batch-size", type=int, default=4096)
    parser.add_argument("--max-message-bytes", type=int, default=64 << 20)
    parser.add_argument("--max-in-flight", type=int, default=16,
                        help="requests scored at once; more are answered with Overloaded")
    parser.add_argument("--idle-timeout-s", type=float, default=600.0,
                        help="a connection silent this long is closed")
    parser.add_argument("--idl", default=DEFAULT_IDL, help="rewards/reward.thrift")
    parser.add_argument("--thrift", default="thrift", help="the thrift compiler")
    args = parser.parse_args()

    # SIGTERM ends the accept loop like Ctrl-C does; connection threads are daemons.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    gen_dir = tempfile.mkdtemp(prefix="tandem-reward-py-")
    try:
        generate_bindings(args.thrift, args.idl, gen_dir)
        from tandem_reward import RewardService, constants, ttypes  # noqa: E402 (generated)

        rpc = types.SimpleNamespace(ttypes=ttypes, constants=constants)
        processor = RewardService.Processor(Handler(rpc, args))
        server = TSocket.TServerSocket(host=args.host, port=args.port)
        server.listen()
        # accept() wakes twice a second: Python runs a signal's handler in the main thread only,
        # and if the kernel hands SIGTERM to another thread, a blocked accept() never sees it.
        server.handle.settimeout(0.5)
        print("listening on %d" % server.handle.getsockname()[1], flush=True)
        while True:
            try:
                client = server.accept()
            except socket.timeout:
                continue
            if client is None:
                continue
            client.setTimeout(args.idle_timeout_s * 1000)
            # Started with SIGTERM and SIGINT blocked, so the kernel delivers them to this (main)
            # thread: one delivered to a connection thread would leave accept() waiting and the
            # handler unrun until the next connection.
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
            try:
                threading.Thread(target=serve_connection, args=(processor, client, args),
                                 daemon=True).start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    except KeyboardInterrupt:
        pass
    finally:
        shutil.rmtree(gen_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
