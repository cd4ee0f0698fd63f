"""A minimal worker for the WorkerProcess tests: echoes requests, and crashes or hangs on demand."""

ECHO = """
import json, os
requests = os.fdopen(int(os.environ['CUDA_AGENT_REQUEST_FD']), 'rb', buffering=0)
replies = os.fdopen(int(os.environ['CUDA_AGENT_RESPONSE_FD']), 'wb', buffering=0)
buffer = b''
while True:
    chunk = requests.read(1024)
    if not chunk:
        break
    buffer += chunk
    while b'\\n' in buffer:
        line, _, buffer = buffer.partition(b'\\n')
        msg = json.loads(line)
        print('noise on stdout that must not be read as a reply', flush=True)
        if msg['op'] == 'crash':
            os._exit(7)
        if msg['op'] == 'hang':
            import time; time.sleep(60)
        replies.write((json.dumps({'echo': msg['value'], 'nonce': msg['nonce']}) + '\\n').encode())
"""
