from rest_framework.pagination import LimitOffsetPagination


class Pagination(LimitOffsetPagination):
    """``?limit=&offset=``; limits are capped so one request cannot dump a huge table."""

    default_limit = 50
    max_limit = 1000
