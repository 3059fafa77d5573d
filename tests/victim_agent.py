"""The victim of tests/test_py_attacks.py: an agent (with a token where one is given)
that registers 1 MiB of shared memory holding a known pattern, says where it is as one
JSON line, then answers ``ping`` on stdin with a JSON line (it is alive, and how many
notifications it has) until stdin closes.

    python victim_agent.py [TOKEN]
"""

import json
import os
import sys

import numpy as np

import freight

MIB = 1 << 20


def main() -> None:
    token = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else None
    with freight.Agent("victim", freight.AgentConfig(token=token)) as agent:
        memory = agent.alloc(MIB)
        memory[:] = np.arange(MIB, dtype=np.uint64) % 251
        key = agent.register(memory)
        print(json.dumps({
            "addr": agent.addresses[0],
            "metadata": agent.metadata().hex(),
            "key": key,
            "at": memory.ctypes.data,
            "len": memory.nbytes,
            "pid": os.getpid(),
        }), flush=True)
        notifs = 0
        for line in sys.stdin:
            if line.strip() == "ping":
                notifs += len(agent.get_notifs())
                whole = bool((memory == np.arange(MIB, dtype=np.uint64) % 251).all())
                print(json.dumps({"pong": True, "notifs": notifs, "memory_whole": whole}), flush=True)


if __name__ == "__main__":
    main()
