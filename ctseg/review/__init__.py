"""`ctseg review`: a browser page for reviewing a batch of predictions (the review extra).

`batch` reads a predict or evaluate folder's cases in the page's order, `marks` keeps the
reviewer's marks (review.json), `files` says which bytes may be sent for a case, and
`server` is the web server (Starlette, uvicorn) with the page and NiiVue in `static/`.
"""
