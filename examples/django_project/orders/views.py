from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from .services import place_order


@csrf_exempt
@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    order = place_order(request.POST.get("item", "book"))
    return JsonResponse({"order": order.pk}, status=201)
