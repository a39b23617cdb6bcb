"""`GET /`: the web page (`router`); the page itself is `xstage_dit/server/static/index.html`."""
