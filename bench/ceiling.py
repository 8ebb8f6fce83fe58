"""The ceiling of `make bench`: a bare Bottle app on gevent's WSGI server answering {"status":"ok"}.

    python bench/ceiling.py PORT [nodelay|delay]

With `nodelay` every accepted connection gets TCP_NODELAY, as marketplace.py's server does; with `delay`
it keeps Nagle's algorithm, to show what that costs a kept-alive client.
"""

from gevent import monkey

monkey.patch_all()

import socket  # noqa: E402
import sys  # noqa: E402

import bottle  # noqa: E402
from gevent.pywsgi import WSGIServer  # noqa: E402

app = bottle.Bottle()


@app.get('/')
def ok():
    bottle.response.content_type = 'application/json'
    return b'{"status":"ok"}'


class Server(WSGIServer):
    nodelay = True

    def handle(self, sock, address):
        if self.nodelay:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().handle(sock, address)


if __name__ == '__main__':
    Server.nodelay = sys.argv[2] != 'delay'
    Server(('127.0.0.1', int(sys.argv[1])), app, log=None, backlog=1024).serve_forever()
