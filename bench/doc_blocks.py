"""A page's generated block: the text between two marker lines, written by a script from
a results JSON, so that a page quotes what the JSON holds and a test can compare them."""


def block(page, begin, end):
    """The text between the lines `begin` and `end` in `page` (ValueError when they are
    not there once each)."""
    if page.count(begin) != 1 or page.count(end) != 1:
        raise ValueError(f"the page must hold the lines {begin!r} and {end!r} once each")
    return page.split(begin)[1].split(end)[0].strip("\n")


def write(path, begin, end, text):
    """Replaces the block between `begin` and `end` of the page at `path` by `text`."""
    with open(path, encoding="utf-8") as f:
        page = f.read()
    old = block(page, begin, end)
    page = page.replace(f"{begin}\n{old}\n{end}" if old else f"{begin}\n{end}",
                        f"{begin}\n{text}\n{end}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
