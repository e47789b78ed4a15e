"""Tools run by hand beside the product (``python -m tools.<name>``): the quality tables edgekv ships
(profiles/quality/) and a check of a deploy's adapter choice on other text."""
